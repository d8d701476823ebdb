"""`zstd`: zstandard on each chunk's raw bytes, the general-purpose bit-exact baseline."""

from __future__ import annotations

import dataclasses

import torch

from kvlab.codec.base import ChunkShape, Codec, check_level, codecs, zstd_compress, zstd_decompress
from kvlab.codec.raw import bytes_into_chunk, chunk_to_bytes


@codecs.register("zstd")
@dataclasses.dataclass
class ZstdCodec(Codec):
    """Bit-exact: zstd on the raw little-endian bytes of each chunk, token-major.

    Family: bit-exact codecs. The baseline that byte-plane splitting is measured against: zstd sees the
    noisy low mantissa byte interleaved with the compressible sign/exponent byte.
    """

    level: int = dataclasses.field(default=3, metadata={"help": "zstd level (1..22)"})

    lossless = "bit-exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_level(self.level)

    def encode_chunk(self, chunk: torch.Tensor) -> bytes:
        return zstd_compress(chunk_to_bytes(chunk), self.level)

    def decode_chunk(self, payload: bytes | memoryview, shape: ChunkShape, dtype: torch.dtype) -> torch.Tensor:
        target = torch.empty(shape, dtype=dtype)
        self.decode_chunk_into(payload, target)
        return target

    def decode_chunk_into(self, payload: bytes | memoryview, target: torch.Tensor) -> None:
        bytes_into_chunk(zstd_decompress(payload, target.numel() * target.element_size()), target)
