"""Quantization family: the base owns the full-precision residual window and the flush units;
a method only quantizes and dequantizes blocks of tokens.

Storage of one layer of one sequence = quantized blocks (oldest tokens) + a residual window of the
most recent tokens in full precision. The prompt leaves at least `residual_length` tokens in the
residual; while decoding, whenever the residual reaches `residual_length + flush_size` tokens its
oldest `flush_size` tokens are quantized (the cache layer applies this with the methods below).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import torch

from kvlab.compress.base import FP16_BYTES, MAX_TOKENS, CompressedKV, CompressionContext, Compressor, check_range
from kvlab.errors import ConfigError

FULL_PRECISION_BITS = 16


def pack_code_tensor(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in [0, 2**bits) packed on their own device, with the bytes of `kvlab.quant.packing.pack_codes`.

    Args:
        codes: Integer codes of any shape (flattened in order).
        bits: Code width, 1..8.

    Returns:
        [ceil(numel * bits / 8)] uint8 on the codes' device.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    flat = codes.reshape(-1).to(torch.uint8)
    if 8 % bits:
        # A bit stream, most significant bit of each code first.
        shifts = torch.arange(bits - 1, -1, -1, device=codes.device, dtype=torch.uint8)
        stream = ((flat[:, None] >> shifts) & 1).reshape(-1)
        return _pack_lanes(stream, 1, msb_first=True)
    return _pack_lanes(flat, bits, msb_first=False)


def unpack_code_tensor(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_code_tensor`: the first `count` codes as flat uint8 on the packed bytes' device."""
    if 8 % bits:
        stream = _unpack_lanes(packed, 1, msb_first=True)[: count * bits].reshape(count, bits)
        weights = torch.arange(bits - 1, -1, -1, device=packed.device, dtype=torch.uint8)
        return (stream << weights).sum(dim=1, dtype=torch.uint8)
    return _unpack_lanes(packed, bits, msb_first=False)[:count]


def _pack_lanes(flat: torch.Tensor, bits: int, msb_first: bool) -> torch.Tensor:
    per_byte = 8 // bits
    padding = -flat.numel() % per_byte
    lanes = torch.nn.functional.pad(flat, (0, padding)).reshape(-1, per_byte)
    shifts = torch.arange(per_byte, device=flat.device, dtype=torch.uint8) * bits
    if msb_first:
        shifts = shifts.flip(0)
    return (lanes << shifts).sum(dim=1, dtype=torch.uint8)


def _unpack_lanes(packed: torch.Tensor, bits: int, msb_first: bool) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8) * bits
    if msb_first:
        shifts = shifts.flip(0)
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)


class QuantizedBlock(abc.ABC):
    """Quantized keys or values of a run of tokens, [H_kv, n, D] once dequantized."""

    num_tokens: int

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of codes, scales, norms and anything else the block stores."""


@dataclasses.dataclass(slots=True)
class QuantizedKV(CompressedKV):
    """Quantized blocks of one layer plus the full-precision residual window.

    Attributes:
        key_blocks: Quantized key blocks, oldest first.
        value_blocks: Quantized value blocks, aligned with `key_blocks`.
        residual_keys: [H_kv, R, D] most recent keys in full precision.
        residual_values: [H_kv, R, D].
        compressor: The method that dequantizes the blocks.
    """

    key_blocks: list[QuantizedBlock]
    value_blocks: list[QuantizedBlock]
    residual_keys: torch.Tensor
    residual_values: torch.Tensor
    compressor: QuantizationCompressor

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.residual_keys.dtype
        keys = [self.compressor.dequantize_keys(b).to(dtype) for b in self.key_blocks] + [self.residual_keys]
        values = [self.compressor.dequantize_values(b).to(dtype) for b in self.value_blocks] + [self.residual_values]
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def nbytes(self) -> int:
        blocks = sum(b.nbytes() for b in self.key_blocks) + sum(b.nbytes() for b in self.value_blocks)
        return blocks + 2 * self.residual_keys.numel() * FP16_BYTES + self.compressor.overhead_nbytes()


@dataclasses.dataclass
class QuantizationCompressor(Compressor):
    """Family base: bits, flush units and the residual window; subclasses quantize blocks.

    Class attributes:
        allowed_bits: Bit widths the method supports; 16 always means "store full precision".
    """

    allowed_bits: ClassVar[tuple[int, ...]] = (FULL_PRECISION_BITS,)

    bits: int = dataclasses.field(default=4, metadata={"help": "bits per code (16 = full precision, identity)"})
    residual_length: int = dataclasses.field(
        default=128, metadata={"help": "most recent tokens kept in full precision"}
    )

    def __post_init__(self) -> None:
        if self.bits not in self.allowed_bits:
            allowed = ", ".join(str(b) for b in self.allowed_bits)
            raise ConfigError(f"bits must be one of {allowed}, got {self.bits}")
        check_range("residual_length", self.residual_length, 0, MAX_TOKENS)

    @property
    def is_identity(self) -> bool:
        return self.bits == FULL_PRECISION_BITS

    @property
    def flush_size(self) -> int:
        """Tokens quantized together (a group for per-channel key quantization, else 1)."""
        return 1

    def num_to_quantize(self, num_tokens: int) -> int:
        """How many of the oldest `num_tokens` tokens belong in quantized storage."""
        if self.is_identity or num_tokens < self.residual_length + self.flush_size:
            return 0
        return (num_tokens - self.residual_length) // self.flush_size * self.flush_size

    def overhead_nbytes(self) -> int:
        """Bytes stored once per layer and sequence (e.g. a rotation seed)."""
        return 0

    @abc.abstractmethod
    def quantize_keys(self, keys: torch.Tensor, layer_idx: int) -> QuantizedBlock:
        """Quantize keys [H_kv, n, D], n a multiple of `flush_size` (groups of `flush_size` tokens)."""

    @abc.abstractmethod
    def dequantize_keys(self, block: QuantizedBlock) -> torch.Tensor:
        """[H_kv, n, D] float32 keys of a block."""

    @abc.abstractmethod
    def quantize_values(self, values: torch.Tensor, layer_idx: int) -> QuantizedBlock:
        """Quantize values [H_kv, n, D]."""

    @abc.abstractmethod
    def dequantize_values(self, block: QuantizedBlock) -> torch.Tensor:
        """[H_kv, n, D] float32 values of a block."""

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> QuantizedKV:
        num_quantized = self.num_to_quantize(keys.shape[1])
        key_blocks, value_blocks = [], []
        if num_quantized:
            # One block for the whole quantized prompt: groups never straddle a multiple of flush_size.
            key_blocks.append(self.quantize_keys(keys[:, :num_quantized], context.layer_idx))
            value_blocks.append(self.quantize_values(values[:, :num_quantized], context.layer_idx))
        return QuantizedKV(
            key_blocks, value_blocks, keys[:, num_quantized:], values[:, num_quantized:], compressor=self
        )

