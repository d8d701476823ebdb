"""kvlab's KV cache: the only code that stores, extends, crops and copies keys and values.

A `KVCache` holds one layer object per model layer and the true sequence length of each batch row.
Layers decide how they store tokens (`FullKVLayer` keeps every token in a preallocated buffer;
compressed layers in `kvlab.cache.compressed` and tiered ones in `kvlab.cache.tiers` keep the same
`KVLayer` contract, in `kvlab.cache.layers`). Rows of a batch may hold different lengths, which is what
speculative decoding needs after rows accept different numbers of tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvlab.cache.compressed import make_layer
from kvlab.cache.layers import FullKVLayer, KVLayer, LayerGeometry, LayerKV
from kvlab.compress.base import Compressor, full_kv_nbytes
from kvlab.models.architecture import ModelArchitecture

# Names other cache modules import from here (kvlab.cache.tiers builds on FullKVLayer).
__all__ = ["FullKVLayer", "KVCache", "KVLayer", "LayerGeometry", "LayerKV"]


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
        geometry = LayerGeometry(batch_size, architecture.num_kv_heads, architecture.head_dim, capacity, dtype, device)
        layers = [make_layer(compressor, geometry, window) for window in architecture.sliding_windows]
        return cls(layers, [0] * batch_size)

    @property
    def compressed(self) -> bool:
        """Some layer is not a plain in-memory `FullKVLayer` (a compressor's layer, or a tiered one)."""
        return any(type(layer) is not FullKVLayer for layer in self.layers)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lengths)

    def stored_tokens(self, row: int = 0) -> int:
        """Tokens row `row` holds in storage: a compressed cache's kept ones, not the tokens it has consumed
        (`seq_lengths`). What a forward over it attends to, read from the first layer."""
        return int(self.layers[0].lengths[row])  # type: ignore[attr-defined]

    def next_positions(self, num_new: int, device: torch.device | str) -> torch.Tensor:
        """[B, num_new] int64 positions of the next tokens of every row."""
        starts = torch.tensor(self.seq_lengths, dtype=torch.long)
        return (starts[:, None] + torch.arange(num_new)).to(device)

    def advance(self, counts: int | list[int]) -> None:
        """Record that row b consumed counts[b] more tokens (an int: every row the same)."""
        per_row = [counts] * self.batch_size if isinstance(counts, int) else counts
        self.seq_lengths = [length + count for length, count in zip(self.seq_lengths, per_row, strict=True)]

    def append(self, layer_kv: LayerKV, counts: list[int]) -> None:
        """Store keys/values computed elsewhere (e.g. by the verify pass): counts[b] tokens of row b.

        Args:
            layer_kv: Per layer, ([B, H_kv, q, D] keys, values) with rotary applied.
            counts: Tokens to take from the front of each row's q.
        """
        for layer, (keys, values) in zip(self.layers, layer_kv, strict=True):
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
        for start, (keys, values) in zip(starts, chunks, strict=True):
            if start > self.seq_lengths[0]:
                self.advance(start - self.seq_lengths[0])
            layer_kv = [
                (keys[layer][None].to(device), values[layer][None].to(device)) for layer in range(keys.shape[0])
            ]
            self.append(layer_kv, [keys.shape[2]])

    def drop_last(self, counts: int | list[int]) -> None:
        """Roll back the counts[b] most recent tokens of each row."""
        per_row = [counts] * self.batch_size if isinstance(counts, int) else counts
        if not any(per_row):
            return  # a round that rejected nothing (or drafted nothing) rolls nothing back
        self.crop([length - count for length, count in zip(self.seq_lengths, per_row, strict=True)])

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
        if any(target < 0 or target > length for target, length in zip(targets, self.seq_lengths, strict=True)):
            raise ValueError(f"cannot crop rows of lengths {self.seq_lengths} to {targets}")
        counts = [length - target for length, target in zip(self.seq_lengths, targets, strict=True)]
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
