"""kvlab's KV cache: the only code that stores, extends, crops and copies keys and values.

A `KVCache` holds one layer object per model layer and the true sequence length of each batch row.
Layers decide how they store tokens (`FullKVLayer` keeps every token in a preallocated buffer;
compressed layers in `kvlab.cache.compressed` and tiered ones in `kvlab.cache.tiers` keep the same
`KVLayer` contract). Rows of a batch may hold different lengths, which is what speculative decoding
needs after rows accept different numbers of tokens.
"""

from __future__ import annotations

import abc
import contextlib
import copy
from collections.abc import Iterator

import torch

from kvlab.cache.attention import attend, attend_newest
from kvlab.compress.base import Compressor, full_kv_nbytes
from kvlab.models.architecture import ModelArchitecture


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

    def compress_prompt(self, queries: torch.Tensor, scaling: float, layer_idx: int) -> None:
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
        for row, (start, count) in enumerate(zip(self.lengths, counts)):
            self.keys[row, :, start : start + count] = new_keys[row, :, :count]
            self.values[row, :, start : start + count] = new_values[row, :, :count]
        self.lengths = [length + count for length, count in zip(self.lengths, counts)]

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
            query_positions - first if first else query_positions,
            [length - first for length in self.lengths] if first else self.lengths,
            scaling,
            sliding_window=window,
            softcap=softcap,
        )
        return output.to(queries.dtype)

    def attend_newest(
        self, queries: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> torch.Tensor:
        num_keys = self.lengths[0]
        windowed = self.sliding_window is not None and num_keys > self.sliding_window
        if len(self.lengths) != 1 or windowed or softcap is not None:
            return self.attend(queries, query_positions, scaling, softcap)
        keys, values = self.keys[:, :, :num_keys], self.values[:, :, :num_keys]
        return attend_newest(queries.to(keys.dtype), keys, values, scaling).to(queries.dtype)

    def drop_last(self, counts: list[int]) -> None:
        if any(count < 0 or count > length for count, length in zip(counts, self.lengths)):
            raise ValueError(f"cannot drop {counts} tokens from rows holding {self.lengths}")
        self.lengths = [length - count for length, count in zip(self.lengths, counts)]

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
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        return FullKVLayer(batch_size, heads, dim, capacity, self.keys.dtype, self.keys.device, self.sliding_window)

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


class KVCache:
    """Per-layer KV storage for a batch of sequences, plus each row's true sequence length.

    A layer may store fewer tokens than the sequence holds (after eviction), so positions for the next
    forward come from `seq_lengths`, never from what a layer stores.
    """

    def __init__(self, layers: list[KVLayer], seq_lengths: list[int]) -> None:
        self.layers = layers
        self.seq_lengths = list(seq_lengths)

    @classmethod
    def allocate(
        cls,
        architecture: ModelArchitecture,
        batch_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        compressor: Compressor | None = None,
    ) -> KVCache:
        """An empty cache able to hold `capacity` tokens per row before it grows.

        Args:
            compressor: None stores every token; a compressor makes every full-attention layer compress
                the prompt on the forward that passes `compress=True` (sliding-window layers, already
                bounded, store every token of their window).
        """
        from kvlab.cache.compressed import make_layer

        layers = [
            make_layer(compressor, batch_size, architecture.num_kv_heads, architecture.head_dim, capacity, dtype, device, window)
            for window in architecture.sliding_windows
        ]
        return cls(layers, [0] * batch_size)

    @property
    def compressed(self) -> bool:
        """Some layer is not a plain in-memory `FullKVLayer` (a compressor's layer, or a tiered one)."""
        return any(type(layer) is not FullKVLayer for layer in self.layers)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lengths)

    def next_positions(self, num_new: int, device: torch.device | str) -> torch.Tensor:
        """[B, num_new] int64 positions of the next tokens of every row."""
        starts = torch.tensor(self.seq_lengths, dtype=torch.long)
        return (starts[:, None] + torch.arange(num_new)).to(device)

    def advance(self, counts: int | list[int]) -> None:
        """Record that row b consumed counts[b] more tokens (an int: every row the same)."""
        per_row = [counts] * self.batch_size if isinstance(counts, int) else counts
        self.seq_lengths = [length + count for length, count in zip(self.seq_lengths, per_row)]

    def append(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], counts: list[int]) -> None:
        """Store keys/values computed elsewhere (e.g. by the verify pass): counts[b] tokens of row b.

        Args:
            layer_kv: Per layer, ([B, H_kv, q, D] keys, values) with rotary applied.
            counts: Tokens to take from the front of each row's q.
        """
        for layer, (keys, values) in zip(self.layers, layer_kv):
            layer.append(keys, values, counts)
        self.advance(counts)

    def restore_chunks(
        self, starts: list[int], chunks: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str
    ) -> None:
        """Append stored chunks of a single-row cache's sequence, in order (prefix reuse).

        A chunk after a gap is stored right after the previous ones (compacted) while the sequence
        length jumps over the gap, so later tokens get their true positions.

        Args:
            starts: Sequence position of each chunk's first token (increasing, >= the current length).
            chunks: Per chunk, ([L, H_kv, T, D] keys, values) for every layer.
            device: Where the cache's tensors live.
        """
        for start, (keys, values) in zip(starts, chunks):
            if start > self.seq_lengths[0]:
                self.advance(start - self.seq_lengths[0])
            layer_kv = [(keys[layer][None].to(device), values[layer][None].to(device)) for layer in range(keys.shape[0])]
            self.append(layer_kv, [keys.shape[2]])

    def drop_last(self, counts: int | list[int]) -> None:
        """Roll back the counts[b] most recent tokens of each row."""
        per_row = [counts] * self.batch_size if isinstance(counts, int) else counts
        self.crop([length - count for length, count in zip(self.seq_lengths, per_row)])

    @contextlib.contextmanager
    def provisional(self) -> Iterator[None]:
        """Tokens appended inside are provisional: compressed layers postpone compressing them, so a
        rollback (e.g. of rejected draft tokens) never has to undo a compression."""
        self.set_provisional(True)
        try:
            yield
        finally:
            self.set_provisional(False)

    def set_provisional(self, provisional: bool) -> None:
        """`provisional()` for code whose provisional span does not fit a `with` block."""
        for layer in self.layers:
            layer.deferred = provisional

    def crop(self, lengths: int | list[int]) -> None:
        """Roll every row back so it holds exactly its first `lengths[b]` tokens."""
        targets = [lengths] * self.batch_size if isinstance(lengths, int) else list(lengths)
        if len(targets) != self.batch_size:
            raise ValueError(f"crop needs {self.batch_size} lengths, got {len(targets)}")
        if any(target < 0 or target > length for target, length in zip(targets, self.seq_lengths)):
            raise ValueError(f"cannot crop rows of lengths {self.seq_lengths} to {targets}")
        counts = [length - target for length, target in zip(self.seq_lengths, targets)]
        for layer in self.layers:
            layer.drop_last(counts)
        self.seq_lengths = targets

    def select_rows(self, rows: list[int]) -> None:
        """Keep only the given rows (e.g. drop finished sequences from a batch)."""
        for layer in self.layers:
            layer.select_rows(rows)
        self.seq_lengths = [self.seq_lengths[row] for row in rows]

    def clone(self) -> KVCache:
        return KVCache([layer.clone() for layer in self.layers], self.seq_lengths)

    def nbytes(self) -> int:
        """Bytes of the stored representation (full-precision parts counted in fp16)."""
        return sum(layer.nbytes() for layer in self.layers)

    def resident_bytes(self) -> int:
        """Bytes of KV tensors held in memory, spare capacity and working copies included."""
        return sum(layer.resident_bytes() for layer in self.layers)

    def full_nbytes(self) -> int:
        """Bytes the same tokens would take uncompressed in fp16: the numerator of `kv_bytes_ratio`."""
        layer = self.layers[0]
        assert isinstance(layer, FullKVLayer)
        per_layer = full_kv_nbytes(sum(self.seq_lengths), layer.keys.shape[1], layer.keys.shape[3])
        return per_layer * len(self.layers)

    @classmethod
    def stack(cls, caches: list[KVCache], capacity: int) -> KVCache:
        """One batch cache holding the rows of single-row caches (after per-prompt prefill).

        Args:
            caches: Caches of batch size 1 with the same layer kinds.
            capacity: Tokens per row to reserve in the stacked cache.
        """
        layers = []
        for layer_idx, template in enumerate(caches[0].layers):
            stacked = template.empty_like(len(caches), capacity)
            for row, cache in enumerate(caches):
                stacked.copy_row_from(cache.layers[layer_idx], 0, row)
            layers.append(stacked)
        return cls(layers, [cache.seq_lengths[0] for cache in caches])
