"""KIVI: asymmetric low-bit quantization, keys per channel and values per token."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from kvlab.compress.base import FP16_BYTES, MAX_TOKENS, check_range, compressors
from kvlab.compress.quantization import (
    FULL_PRECISION_BITS,
    QuantizationCompressor,
    QuantizedBlock,
    pack_code_tensor,
    unpack_code_tensor,
)
from kvlab.quant.groupwise import QuantizedGroups, dequantize, quantize
from kvlab.quant.packing import packed_nbytes


@dataclasses.dataclass(slots=True)
class UniformBlock(QuantizedBlock):
    """Min-max quantized tokens: packed codes plus an fp16 zero point and scale per group.

    Attributes:
        packed: uint8 codes, `bits` wide, packed densely.
        zeros: fp16 group minima (rounded down), grouped axis shortened to the group count.
        scales: fp16 group steps (rounded up), same shape as `zeros`.
        shape: [H_kv, n, D] shape of the tokens.
        bits: Code width.
        axis: The grouped axis (1: tokens, keys per channel; 2: channels, values per token).
        group_size: Elements per group along `axis`.
    """

    packed: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int, int]
    bits: int
    axis: int
    group_size: int

    @property
    def num_tokens(self) -> int:  # type: ignore[override]
        return self.shape[1]

    def nbytes(self) -> int:
        count = self.shape[0] * self.shape[1] * self.shape[2]
        return packed_nbytes(count, self.bits) + (self.zeros.numel() + self.scales.numel()) * FP16_BYTES

    def groups(self) -> QuantizedGroups:
        count = self.shape[0] * self.shape[1] * self.shape[2]
        codes = unpack_code_tensor(self.packed, self.bits, count).view(self.shape)
        return QuantizedGroups(codes, self.zeros, self.scales, self.bits, self.axis, self.group_size)


@compressors.register("kivi")
@dataclasses.dataclass
class KIVICompressor(QuantizationCompressor):
    """KIVI (Liu et al., ICML 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache").

    Family: quantization. Keys are quantized per channel over groups of `group_size` tokens (outlier
    channels get their own range); values per token over groups of `group_size` channels. The most
    recent `residual_length` tokens stay in full precision; as decoding adds tokens, the oldest
    `group_size` of the residual are quantized together.

    Budget: `bits` per code (2, 4 or 8; 16 stores everything in full precision). Stored bytes add an
    fp16 scale and zero point per group and the residual window in fp16. Zero points round down and
    scales up to fp16, so every element stays within half a step of its dequantized value.

    Deviations from the paper:
    - The residual holds between `residual_length` and `residual_length + group_size - 1` tokens
      (KIVI's code flushes the whole residual when it is full); the memory bound is the same.
    - Codes are packed densely on the cache's device; attention reads an incrementally updated dequantized
      copy (KIVI fuses dequantization into its CUDA matmul).
    """

    allowed_bits: ClassVar[tuple[int, ...]] = (2, 4, 8, FULL_PRECISION_BITS)

    group_size: int = dataclasses.field(default=32, metadata={"help": "tokens per key group, channels per value group"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("group_size", self.group_size, 1, MAX_TOKENS)

    @property
    def flush_size(self) -> int:
        return self.group_size

    def quantize_keys(self, keys: torch.Tensor, layer_idx: int) -> UniformBlock:
        return self._block(keys, axis=1)

    def dequantize_keys(self, block: QuantizedBlock) -> torch.Tensor:
        assert isinstance(block, UniformBlock)
        return dequantize(block.groups())

    def quantize_values(self, values: torch.Tensor, layer_idx: int) -> UniformBlock:
        return self._block(values, axis=2)

    def dequantize_values(self, block: QuantizedBlock) -> torch.Tensor:
        return self.dequantize_keys(block)

    def _block(self, tensor: torch.Tensor, axis: int) -> UniformBlock:
        groups = quantize(tensor, self.bits, axis=axis, group_size=self.group_size, meta_dtype=torch.float16)
        packed = pack_code_tensor(groups.codes, self.bits)
        return UniformBlock(packed, groups.zeros, groups.scales, tuple(tensor.shape), self.bits, axis, self.group_size)  # type: ignore[arg-type]
