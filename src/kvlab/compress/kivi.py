"""KIVI: asymmetric low-bit quantization, keys per channel and values per token."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from kvlab.compress.base import FP16_BYTES, compressors
from kvlab.compress.packing import pack_codes, packed_nbytes, unpack_codes
from kvlab.compress.quantization import (
    FULL_PRECISION_BITS,
    QuantizationCompressor,
    QuantizedBlock,
    uniform_dequantize,
    uniform_quantize,
)
from kvlab.errors import ConfigError


@dataclasses.dataclass(slots=True)
class UniformBlock(QuantizedBlock):
    """Min-max quantized tokens: packed codes plus fp16 scale and zero point per group.

    Attributes:
        packed: Flat uint8 tensor of `bits`-wide codes.
        scale: fp16 scales, broadcastable to the grouped shape.
        zero: fp16 zero points, same shape as `scale`.
        grouped_shape: Shape of the codes before packing (groups on their own axis).
        shape: [H_kv, n, D] shape of the tokens.
        bits: Code width.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    grouped_shape: tuple[int, ...]
    shape: tuple[int, int, int]
    bits: int

    @property
    def num_tokens(self) -> int:  # type: ignore[override]
        return self.shape[1]

    def nbytes(self) -> int:
        return packed_nbytes(self.packed_numel, self.bits) + (self.scale.numel() + self.zero.numel()) * FP16_BYTES

    @property
    def packed_numel(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    def codes(self) -> torch.Tensor:
        return unpack_codes(self.packed, self.bits, self.packed_numel).view(self.grouped_shape)


@compressors.register("kivi")
@dataclasses.dataclass
class KIVICompressor(QuantizationCompressor):
    """KIVI (Liu et al., ICML 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

    Family: quantization. Keys are quantized per channel over groups of `group_size` tokens (outlier
    channels get their own range); values per token over groups of `group_size` channels. The most
    recent `residual_length` tokens stay in full precision; as decoding adds tokens, the oldest
    `group_size` of the residual are quantized together.

    Budget: `bits` per code (2, 4 or 8; 16 stores everything in full precision). Stored bytes add an
    fp16 scale and zero point per group and the residual window in fp16.

    Deviations from the paper:
    - The residual holds between `residual_length` and `residual_length + group_size - 1` tokens
      (KIVI's code flushes the whole residual when it is full); the memory bound is the same.
    - Codes are packed densely on the CPU; attention reads an incrementally updated dequantized
      copy (KIVI fuses dequantization into its CUDA matmul).
    """

    allowed_bits: ClassVar[tuple[int, ...]] = (2, 4, 8, FULL_PRECISION_BITS)

    group_size: int = dataclasses.field(default=32, metadata={"help": "tokens per key group, channels per value group"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 1:
            raise ConfigError(f"group_size must be at least 1, got {self.group_size}")

    @property
    def flush_size(self) -> int:
        return self.group_size

    def quantize_keys(self, keys: torch.Tensor, layer_idx: int) -> UniformBlock:
        heads, tokens, dim = keys.shape
        grouped = keys.reshape(heads, tokens // self.group_size, self.group_size, dim)
        return self._block(grouped, reduce_dim=2, shape=(heads, tokens, dim))

    def dequantize_keys(self, block: QuantizedBlock) -> torch.Tensor:
        assert isinstance(block, UniformBlock)
        return uniform_dequantize(block.codes(), block.scale, block.zero).reshape(block.shape)

    def quantize_values(self, values: torch.Tensor, layer_idx: int) -> UniformBlock:
        heads, tokens, dim = values.shape
        channel_group = min(self.group_size, dim)
        if dim % channel_group:
            raise ConfigError(f"group_size {self.group_size} must divide head_dim {dim} for value groups")
        grouped = values.reshape(heads, tokens, dim // channel_group, channel_group)
        return self._block(grouped, reduce_dim=3, shape=(heads, tokens, dim))

    def dequantize_values(self, block: QuantizedBlock) -> torch.Tensor:
        return self.dequantize_keys(block)

    def _block(self, grouped: torch.Tensor, reduce_dim: int, shape: tuple[int, int, int]) -> UniformBlock:
        codes, scale, zero = uniform_quantize(grouped, self.bits, dim=reduce_dim)
        return UniformBlock(pack_codes(codes, self.bits), scale, zero, tuple(grouped.shape), shape, self.bits)
