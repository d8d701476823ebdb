"""Cache layers that store a compressor's output and keep decoding on it.

Both kinds reuse `FullKVLayer`'s buffers for what attention reads, so decoding attends over exactly
the stored tokens with the same kernel as the full cache:
- `EvictedKVLayer` holds the kept prompt tokens, compacted, followed by every generated token;
- `QuantizedKVLayer` holds the quantized blocks (the stored representation) and a dequantized working
  copy of them, updated only when a block is quantized, plus the full-precision residual window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from kvlab.cache.layers import FullKVLayer, KVLayer, LayerGeometry
from kvlab.compress.base import CompressionContext, Compressor, full_kv_nbytes
from kvlab.compress.eviction import EvictionCompressor
from kvlab.compress.quantization import QuantizationCompressor, QuantizedBlock


def make_layer(compressor: Compressor | None, geometry: LayerGeometry, sliding_window: int | None) -> KVLayer:
    """The layer kind that stores what `compressor` keeps (sliding-window layers stay full)."""
    if compressor is None or sliding_window is not None:
        return FullKVLayer.create(geometry, sliding_window)
    if isinstance(compressor, EvictionCompressor):
        return EvictedKVLayer(compressor, geometry)
    if isinstance(compressor, QuantizationCompressor):
        return QuantizedKVLayer(compressor, geometry)
    raise TypeError(f"no cache layer for compressor family {type(compressor).__mro__[1].__name__}")


def _context(
    compressor: Compressor, queries: torch.Tensor, row: int, scaling: float, layer_idx: int
) -> CompressionContext:
    observed = queries[row] if compressor.observes_queries else None
    return CompressionContext(observed, scaling, layer_idx)


class CompressedKVLayer(FullKVLayer):
    """What both kinds of compressed layer share: the compressor, and per-row state kept in lists.

    Subclasses name their per-row lists in `row_state` (name -> factory of a row's empty value); this
    base creates them, keeps them in step with `select_rows`, copies them in `copy_row_from` and
    builds `empty_like` layers, so a subclass writes only its storage logic.
    """

    row_state: ClassVar[dict[str, Callable[[], Any]]] = {}
    compressor: Compressor

    def __init__(self, compressor: Compressor, geometry: LayerGeometry) -> None:
        g = geometry
        super().__init__(g.batch_size, g.num_kv_heads, g.head_dim, g.capacity, g.dtype, g.device)
        self.compressor = compressor
        for name, empty in self.row_state.items():
            setattr(self, name, [empty() for _ in range(g.batch_size)])

    def select_rows(self, rows: list[int]) -> None:
        super().select_rows(rows)
        for name in self.row_state:
            state = getattr(self, name)
            setattr(self, name, [state[row] for row in rows])

    def empty_like(self, batch_size: int, capacity: int) -> CompressedKVLayer:
        return type(self)(self.compressor, self.geometry.resized(batch_size, capacity))

    def copy_row_from(self, source: KVLayer, source_row: int, row: int) -> None:
        assert type(source) is type(self)
        super().copy_row_from(source, source_row, row)
        for name in self.row_state:
            value = getattr(source, name)[source_row]
            # Block lists are per row: the copy gets its own list (the blocks themselves are immutable).
            getattr(self, name)[row] = list(value) if isinstance(value, list) else value


class EvictedKVLayer(CompressedKVLayer):
    """Kept prompt tokens (compacted, in order) followed by the tokens generated afterwards."""

    row_state: ClassVar[dict[str, Callable[[], Any]]] = {"prompt_nbytes": int, "prompt_lengths": int}
    compressor: EvictionCompressor
    prompt_nbytes: list[int]
    prompt_lengths: list[int]

    def compress_prompt(self, queries: torch.Tensor, scaling: float, layer_idx: int) -> None:
        for row in range(len(self.lengths)):
            keys, values = self.stored(row)
            result = self.compressor.compress(keys, values, _context(self.compressor, queries, row, scaling, layer_idx))
            kept_keys, kept_values = result.materialize()
            kept = kept_keys.shape[1]
            self.keys[row, :, :kept] = kept_keys
            self.values[row, :, :kept] = kept_values
            self.lengths[row] = kept
            self.prompt_lengths[row] = kept
            self.prompt_nbytes[row] = result.nbytes()

    def drop_last(self, counts: list[int]) -> None:
        for row, count in enumerate(counts):
            if self.lengths[row] - count < self.prompt_lengths[row]:
                raise ValueError(f"row {row}: cannot roll back into the compressed prompt")
        super().drop_last(counts)

    def nbytes(self) -> int:
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        generated = sum(length - prompt for length, prompt in zip(self.lengths, self.prompt_lengths, strict=True))
        return sum(self.prompt_nbytes) + full_kv_nbytes(generated, heads, dim)


class QuantizedKVLayer(CompressedKVLayer):
    """Quantized blocks of the oldest tokens plus a full-precision residual window.

    The buffers inherited from `FullKVLayer` are the working copy attention reads: quantized slots hold
    the dequantized values of their block (rewritten once, when the block is quantized), residual
    slots hold the exact values. `nbytes()` counts the blocks and the residual only.
    """

    row_state: ClassVar[dict[str, Callable[[], Any]]] = {
        "key_blocks": list,
        "value_blocks": list,
        "quantized_lengths": int,
        "active": bool,
    }
    compressor: QuantizationCompressor
    key_blocks: list[list[QuantizedBlock]]
    value_blocks: list[list[QuantizedBlock]]
    quantized_lengths: list[int]
    active: list[bool]
    layer_idx: int = 0

    def compress_prompt(self, queries: torch.Tensor, scaling: float, layer_idx: int) -> None:
        self.layer_idx = layer_idx
        for row in range(len(self.lengths)):
            keys, values = self.stored(row)
            result = self.compressor.compress(keys, values, _context(self.compressor, queries, row, scaling, layer_idx))
            self.key_blocks[row], self.value_blocks[row] = [], []
            self.quantized_lengths[row] = 0
            for key_block, value_block in zip(result.key_blocks, result.value_blocks, strict=True):
                self._store_block(row, key_block, value_block)
            self.active[row] = True

    def append(self, new_keys: torch.Tensor, new_values: torch.Tensor, counts: list[int] | None = None) -> None:
        super().append(new_keys, new_values, counts)
        if self.deferred:
            return
        flush = self.compressor.flush_size
        for row, length in enumerate(self.lengths):
            if not self.active[row]:
                continue
            while self.compressor.num_to_quantize(length) > self.quantized_lengths[row]:
                start = self.quantized_lengths[row]
                keys = self.keys[row, :, start : start + flush]
                values = self.values[row, :, start : start + flush]
                self._store_block(
                    row,
                    self.compressor.quantize_keys(keys, self.layer_idx),
                    self.compressor.quantize_values(values, self.layer_idx),
                )

    def _store_block(self, row: int, key_block: QuantizedBlock, value_block: QuantizedBlock) -> None:
        start = self.quantized_lengths[row]
        stop = start + key_block.num_tokens
        self.keys[row, :, start:stop] = self.compressor.dequantize_keys(key_block).to(self.keys.dtype)
        self.values[row, :, start:stop] = self.compressor.dequantize_values(value_block).to(self.values.dtype)
        self.key_blocks[row].append(key_block)
        self.value_blocks[row].append(value_block)
        self.quantized_lengths[row] = stop

    def drop_last(self, counts: list[int]) -> None:
        for row, count in enumerate(counts):
            if self.lengths[row] - count < self.quantized_lengths[row]:
                raise ValueError(
                    f"row {row}: cannot roll back {count} tokens into quantized storage "
                    f"(residual window holds {self.lengths[row] - self.quantized_lengths[row]})"
                )
        super().drop_last(counts)

    def nbytes(self) -> int:
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        blocks = sum(block.nbytes() for row in self.key_blocks + self.value_blocks for block in row)
        residual = sum(
            length - quantized for length, quantized in zip(self.lengths, self.quantized_lengths, strict=True)
        )
        overhead = self.compressor.overhead_nbytes() * sum(self.active)
        return blocks + full_kv_nbytes(residual, heads, dim) + overhead

    def resident_bytes(self) -> int:
        return super().resident_bytes() + sum(
            block.nbytes() for row in self.key_blocks + self.value_blocks for block in row
        )

    def empty_like(self, batch_size: int, capacity: int) -> QuantizedKVLayer:
        layer = super().empty_like(batch_size, capacity)
        assert isinstance(layer, QuantizedKVLayer)
        layer.layer_idx = self.layer_idx
        return layer
