"""Cache layers that store a compressor's output and keep decoding on it.

Both kinds reuse `FullKVLayer`'s buffers for what attention reads, so decoding attends over exactly
the stored tokens with the same kernel as the full cache:
- `EvictedKVLayer` holds the kept prompt tokens, compacted, followed by every generated token;
- `QuantizedKVLayer` holds the quantized blocks (the stored representation) and a dequantized working
  copy of them, updated only when a block is quantized, plus the full-precision residual window.
"""

from __future__ import annotations

import torch

from kvlab.cache.kv_cache import FullKVLayer, KVLayer
from kvlab.compress.base import CompressionContext, Compressor, full_kv_nbytes
from kvlab.compress.eviction import EvictionCompressor
from kvlab.compress.quantization import QuantizationCompressor, QuantizedBlock


def make_layer(
    compressor: Compressor | None,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    capacity: int,
    dtype: torch.dtype,
    device: torch.device | str,
    sliding_window: int | None,
) -> KVLayer:
    """The layer kind that stores what `compressor` keeps (sliding-window layers stay full)."""
    if compressor is None or sliding_window is not None:
        return FullKVLayer(batch_size, num_kv_heads, head_dim, capacity, dtype, device, sliding_window)
    if isinstance(compressor, EvictionCompressor):
        return EvictedKVLayer(compressor, batch_size, num_kv_heads, head_dim, capacity, dtype, device)
    if isinstance(compressor, QuantizationCompressor):
        return QuantizedKVLayer(compressor, batch_size, num_kv_heads, head_dim, capacity, dtype, device)
    raise TypeError(f"no cache layer for compressor family {type(compressor).__mro__[1].__name__}")


def _context(compressor: Compressor, queries: torch.Tensor, row: int, scaling: float, layer_idx: int) -> CompressionContext:
    observed = queries[row] if compressor.observes_queries else None
    return CompressionContext(observed, scaling, layer_idx)


class EvictedKVLayer(FullKVLayer):
    """Kept prompt tokens (compacted, in order) followed by the tokens generated afterwards."""

    def __init__(
        self,
        compressor: EvictionCompressor,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(batch_size, num_kv_heads, head_dim, capacity, dtype, device)
        self.compressor = compressor
        self.prompt_nbytes = [0] * batch_size
        self.prompt_lengths = [0] * batch_size

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

    def select_rows(self, rows: list[int]) -> None:
        super().select_rows(rows)
        self.prompt_nbytes = [self.prompt_nbytes[row] for row in rows]
        self.prompt_lengths = [self.prompt_lengths[row] for row in rows]

    def nbytes(self) -> int:
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        generated = sum(length - prompt for length, prompt in zip(self.lengths, self.prompt_lengths))
        return sum(self.prompt_nbytes) + full_kv_nbytes(generated, heads, dim)

    def empty_like(self, batch_size: int, capacity: int) -> EvictedKVLayer:
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        return EvictedKVLayer(self.compressor, batch_size, heads, dim, capacity, self.keys.dtype, self.keys.device)

    def copy_row_from(self, source: KVLayer, source_row: int, row: int) -> None:
        assert isinstance(source, EvictedKVLayer)
        super().copy_row_from(source, source_row, row)
        self.prompt_nbytes[row] = source.prompt_nbytes[source_row]
        self.prompt_lengths[row] = source.prompt_lengths[source_row]


class QuantizedKVLayer(FullKVLayer):
    """Quantized blocks of the oldest tokens plus a full-precision residual window.

    The buffers inherited from `FullKVLayer` are the working copy attention reads: quantized slots hold
    the dequantized values of their block (rewritten once, when the block is quantized), residual
    slots hold the exact values. `nbytes()` counts the blocks and the residual only.
    """

    def __init__(
        self,
        compressor: QuantizationCompressor,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(batch_size, num_kv_heads, head_dim, capacity, dtype, device)
        self.compressor = compressor
        self.key_blocks: list[list[QuantizedBlock]] = [[] for _ in range(batch_size)]
        self.value_blocks: list[list[QuantizedBlock]] = [[] for _ in range(batch_size)]
        self.quantized_lengths = [0] * batch_size
        self.active = [False] * batch_size
        self.layer_idx = 0

    def compress_prompt(self, queries: torch.Tensor, scaling: float, layer_idx: int) -> None:
        self.layer_idx = layer_idx
        for row in range(len(self.lengths)):
            keys, values = self.stored(row)
            result = self.compressor.compress(keys, values, _context(self.compressor, queries, row, scaling, layer_idx))
            self.key_blocks[row], self.value_blocks[row] = [], []
            self.quantized_lengths[row] = 0
            for key_block, value_block in zip(result.key_blocks, result.value_blocks):
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

    def select_rows(self, rows: list[int]) -> None:
        super().select_rows(rows)
        self.key_blocks = [self.key_blocks[row] for row in rows]
        self.value_blocks = [self.value_blocks[row] for row in rows]
        self.quantized_lengths = [self.quantized_lengths[row] for row in rows]
        self.active = [self.active[row] for row in rows]

    def nbytes(self) -> int:
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        blocks = sum(block.nbytes() for row in self.key_blocks + self.value_blocks for block in row)
        residual = sum(length - quantized for length, quantized in zip(self.lengths, self.quantized_lengths))
        overhead = self.compressor.overhead_nbytes() * sum(self.active)
        return blocks + full_kv_nbytes(residual, heads, dim) + overhead

    def resident_bytes(self) -> int:
        return super().resident_bytes() + sum(
            block.nbytes() for row in self.key_blocks + self.value_blocks for block in row
        )

    def empty_like(self, batch_size: int, capacity: int) -> QuantizedKVLayer:
        heads, dim = self.keys.shape[1], self.keys.shape[3]
        layer = QuantizedKVLayer(self.compressor, batch_size, heads, dim, capacity, self.keys.dtype, self.keys.device)
        layer.layer_idx = self.layer_idx
        return layer

    def copy_row_from(self, source: KVLayer, source_row: int, row: int) -> None:
        assert isinstance(source, QuantizedKVLayer)
        super().copy_row_from(source, source_row, row)
        self.key_blocks[row] = list(source.key_blocks[source_row])
        self.value_blocks[row] = list(source.value_blocks[source_row])
        self.quantized_lengths[row] = source.quantized_lengths[source_row]
        self.active[row] = source.active[source_row]
