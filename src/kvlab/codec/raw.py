"""`raw`: the tensor's bytes unchanged, inside the checked frame (the 1.0x reference)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvlab.codec import layouts
from kvlab.codec.base import ChunkShape, Codec, codecs
from kvlab.codec.errors import CodecError


@codecs.register("raw")
@dataclasses.dataclass
class RawCodec(Codec):
    """Bit-exact, no compression: each chunk's little-endian bytes, token-major.

    Family: bit-exact codecs. Budget: none (ratio 1.0 minus framing). No paper; the baseline every
    other codec is compared with.
    """

    lossless = "bit-exact"

    def encode_chunk(self, chunk: torch.Tensor) -> bytes:
        return chunk_to_bytes(chunk)

    def decode_chunk(self, payload: bytes | memoryview, shape: ChunkShape, dtype: torch.dtype) -> torch.Tensor:
        target = torch.empty(shape, dtype=dtype)
        self.decode_chunk_into(payload, target)
        return target

    def decode_chunk_into(self, payload: bytes | memoryview, target: torch.Tensor) -> None:
        bytes_into_chunk(payload, target)


def chunk_to_bytes(chunk: torch.Tensor) -> bytes:
    """The little-endian bytes of a float chunk."""
    bits = layouts.integer_view(chunk)
    return bits.astype(bits.dtype.newbyteorder("<"), copy=False).tobytes()


def bytes_into_chunk(data: bytes | memoryview, target: torch.Tensor) -> None:
    """Write a chunk's little-endian bytes into `target` `[lead, t, D]` (any strides)."""
    itemsize = target.element_size()
    if len(data) != target.numel() * itemsize:
        raise CodecError(f"chunk has {len(data)} bytes, shape {tuple(target.shape)} of {target.dtype} "
                         f"needs {target.numel() * itemsize}")
    np.copyto(layouts.integer_view(target), np.frombuffer(data, dtype=f"<u{itemsize}").reshape(target.shape))
