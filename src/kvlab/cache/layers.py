"""Cache layers: one attention layer's keys and values for a batch of rows.

`KVLayer` is the contract every layer keeps (compressed layers in `kvlab.cache.compressed` and tiered
ones in `kvlab.cache.tiers` too); `FullKVLayer` keeps every token in a preallocated buffer.
`LayerGeometry` is the shape of a layer's buffers, passed whole wherever a layer is built.
"""

from __future__ import annotations

import abc
import copy
import dataclasses

import torch

from kvlab.attention import Visibility, attend, attend_newest
from kvlab.compress.base import full_kv_nbytes

# Per model layer, ([B, H_kv, q, D] keys, values) with rotary applied: what a forward hands a cache.
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True, slots=True)
class LayerGeometry:
    """The buffers of one layer: [batch_size, num_kv_heads, capacity, head_dim] of `dtype` on `device`."""

    batch_size: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    dtype: torch.dtype
    device: torch.device | str

    def resized(self, batch_size: int, capacity: int) -> LayerGeometry:
        """The same heads, dtype and device for another number of rows and tokens."""
        return dataclasses.replace(self, batch_size=batch_size, capacity=capacity)


class KVLayer(abc.ABC):
    """Storage of one attention layer's keys/values for a batch of rows."""

    sliding_window: int | None
    deferred: bool = False

    @abc.abstractmethod
    def append(self, new_keys: torch.Tensor, new_values: torch.Tensor, counts: list[int] | None = None) -> None:
        """Store new tokens at the end of every row.

        Args:
            new_keys: [B, H_kv, q, D] keys with rotary applied.
            new_values: [B, H_kv, q, D].
            counts: Store only the first counts[b] of the q tokens of row b (default: all q).
        """

    @abc.abstractmethod
    def attend(
        self, queries: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> torch.Tensor:
        """Attention of `queries` [B, H, q, D] at `query_positions` [B, q] over the stored tokens
        (`softcap`: the model's attention-logit soft-cap, e.g. Gemma 2's, or None)."""

    def attend_newest(
        self, queries: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> torch.Tensor:
        """`attend` for a layer holding one row whose newest stored tokens are the queries' own (the
        packed per-sequence forwards of lossless decoding); layers with a faster kernel override it.

        Args:
            queries: [1, H, q, D], rotary applied.
            query_positions: [1, q] int64 true positions.
            scaling: Softmax scale.
            softcap: Attention-logit soft-cap, or None.
        """
        return self.attend(queries, query_positions, scaling, softcap)

    def newest_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values [1, H_kv, T, D] a one-row layer's newest queries attend over with nothing
        hidden from them but their own future (no window): what a packed forward hands, with its other
        segments', to `kvlab.attention.attend_newest_each`; None where the layer attends its own way
        (`attend_newest`)."""
        return None

    @abc.abstractmethod
    def drop_last(self, counts: list[int]) -> None:
        """Forget the `counts[b]` most recently appended tokens of each row b (a rollback)."""

    @abc.abstractmethod
    def select_rows(self, rows: list[int]) -> None:
        """Keep only the given batch rows, in that order."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of the stored representation of the rows' tokens, full-precision parts counted in
        fp16 (kvlab's storage format, and the reference of `kv_bytes_ratio`)."""

    @abc.abstractmethod
    def resident_bytes(self) -> int:
        """Bytes of tensors this layer actually holds in memory (capacity and working copies included)."""

    @abc.abstractmethod
    def empty_like(self, batch_size: int, capacity: int) -> KVLayer:
        """An empty layer of the same kind and settings for `batch_size` rows."""

    @abc.abstractmethod
    def copy_row_from(self, source: KVLayer, source_row: int, row: int) -> None:
        """Make row `row` hold exactly what `source` holds in `source_row` (same layer kind)."""

    def compress_prompt(  # noqa: B027 - a no-op by default, not abstract: layers that keep everything inherit it
        self, queries: torch.Tensor, scaling: float, layer_idx: int
    ) -> None:
        """Compress what the rows hold, after the prompt's forward; layers that keep everything ignore it.

        Args:
            queries: [B, H, T, D] queries of the prompt forward (rotary applied).
            scaling: Softmax scale of the layer.
            layer_idx: The layer's index in the model.
        """

    def clone(self) -> KVLayer:
        return copy.deepcopy(self)


class FullKVLayer(KVLayer):
    """Every token's keys and values, in a buffer that grows by doubling (no per-token copy).

    Buffers are [B, H_kv, capacity, D]; row b is valid up to `lengths[b]`, and a token's index is its
    sequence position.
    """

    # The geometry spelled out field by field: TieredKVLayer (kvlab.cache.tiers) still calls this
    # positionally; new code builds layers with `create(geometry)`.
    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        sliding_window: int | None = None,
    ) -> None:
        shape = (batch_size, num_kv_heads, max(capacity, 1), head_dim)
        # Zeros, not empty: masked attention still multiplies unused slots by a zero weight, and
        # uninitialised memory may hold NaN (0 * NaN = NaN).
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * batch_size
        self.sliding_window = sliding_window

    @classmethod
    def create(cls, geometry: LayerGeometry, sliding_window: int | None = None) -> FullKVLayer:
        """An empty layer with buffers of `geometry` (`sliding_window`: the layer's window, None: global)."""
        g = geometry
        return cls(g.batch_size, g.num_kv_heads, g.head_dim, g.capacity, g.dtype, g.device, sliding_window)

    @property
    def geometry(self) -> LayerGeometry:
        batch_size, num_kv_heads, capacity, head_dim = self.keys.shape
        return LayerGeometry(batch_size, num_kv_heads, head_dim, capacity, self.keys.dtype, self.keys.device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def append(self, new_keys: torch.Tensor, new_values: torch.Tensor, counts: list[int] | None = None) -> None:
        num_new = new_keys.shape[2]
        self._reserve(max(self.lengths) + num_new)
        if counts is None and len(set(self.lengths)) == 1:
            start = self.lengths[0]
            self.keys[:, :, start : start + num_new] = new_keys
            self.values[:, :, start : start + num_new] = new_values
            self.lengths = [length + num_new for length in self.lengths]
            return
        counts = counts or [num_new] * len(self.lengths)
        for row, (start, count) in enumerate(zip(self.lengths, counts, strict=True)):
            self.keys[row, :, start : start + count] = new_keys[row, :, :count]
            self.values[row, :, start : start + count] = new_values[row, :, :count]
        self.lengths = [length + count for length, count in zip(self.lengths, counts, strict=True)]

    def attend(
        self, queries: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> torch.Tensor:
        num_keys = max(self.lengths)
        window = self.sliding_window
        if window is not None and num_keys <= window:
            window = None
        # Keys behind every query's window are not read at all (a decode step of a sliding layer reads
        # `window` keys, not the whole sequence). Each row's queries are its newest q tokens, so the
        # earliest query of any row sits at min(lengths) - q or later; indices and positions shift alike.
        first = 0 if window is None else max(0, min(self.lengths) - queries.shape[2] - window + 1)
        # A drafter with lower-precision weights sends queries in its dtype; keys stay in the cache's.
        output = attend(
            queries.to(self.keys.dtype),
            self.keys[:, :, first:num_keys],
            self.values[:, :, first:num_keys],
            Visibility(
                query_positions - first if first else query_positions,
                [length - first for length in self.lengths] if first else self.lengths,
                sliding_window=window,
            ),
            scaling,
            softcap=softcap,
        )
        return output.to(queries.dtype)

    def attend_newest(
        self, queries: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> torch.Tensor:
        stored = None if softcap is not None else self._newest_views()
        if stored is None:
            return self.attend(queries, query_positions, scaling, softcap)
        keys, values = stored
        return attend_newest(queries.to(keys.dtype), keys, values, scaling).to(queries.dtype)

    def newest_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._newest_views()

    def _newest_views(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        num_keys = self.lengths[0]
        if len(self.lengths) != 1 or (self.sliding_window is not None and num_keys > self.sliding_window):
            return None
        return self.keys[:, :, :num_keys], self.values[:, :, :num_keys]

    def drop_last(self, counts: list[int]) -> None:
        if any(count < 0 or count > length for count, length in zip(counts, self.lengths, strict=True)):
            raise ValueError(f"cannot drop {counts} tokens from rows holding {self.lengths}")
        self.lengths = [length - count for length, count in zip(self.lengths, counts, strict=True)]

    def select_rows(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self.keys.device)
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)
        self.lengths = [self.lengths[row] for row in rows]

    def nbytes(self) -> int:
        return full_kv_nbytes(sum(self.lengths), self.keys.shape[1], self.keys.shape[3])

    def resident_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def empty_like(self, batch_size: int, capacity: int) -> FullKVLayer:
        return FullKVLayer.create(self.geometry.resized(batch_size, capacity), self.sliding_window)

    def copy_row_from(self, source: KVLayer, source_row: int, row: int) -> None:
        assert isinstance(source, FullKVLayer)
        keys, values = source.stored(source_row)
        self._reserve(keys.shape[1])
        self.keys[row, :, : keys.shape[1]] = keys
        self.values[row, :, : values.shape[1]] = values
        self.lengths[row] = keys.shape[1]

    def stored(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [H_kv, T, D] that row `row` holds (views, not copies)."""
        length = self.lengths[row]
        return self.keys[row, :, :length], self.values[row, :, :length]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
            grown[:, :, : old.shape[2]] = old
            setattr(self, name, grown)
