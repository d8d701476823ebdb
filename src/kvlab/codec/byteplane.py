"""`byteplane`: split floats into byte planes, centre the sign/exponent plane, zstd each plane.

Measured on SmolLM2-135M KV (fp16, 4K tokens, 256-token chunks): the low mantissa byte is noise
(8.0 bits of entropy), the high byte carries the redundancy. Subtracting each head-channel's most
frequent high byte (mod 256) lines up the channels' distributions so one zstd Huffman table fits
them all: keys' high plane drops from 5.56 to 5.34 bits, values' from 5.59 to 5.56. Token-major
and channel-major then compress alike (keys 5.34 / 5.34, values 5.56 / 5.67 bits), so token-major,
which needs no transpose, is the default.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch

from kvlab.codec import layouts
from kvlab.codec.base import ChunkShape, Codec, check_level, codecs, zstd_compress, zstd_decompress
from kvlab.codec.errors import CodecError
from kvlab.codec.framing import pack_sections, unpack_sections

PlaneLayout = Literal["token-major", "channel-major"]
PLANE_LAYOUTS = ("token-major", "channel-major")


@codecs.register("byteplane")
@dataclasses.dataclass
class BytePlaneCodec(Codec):
    """Bit-exact: byte-plane split + per-channel centring of the top plane + zstd per plane.

    Family: bit-exact codecs. Related to blosc's byte shuffle and to the byte grouping of KV codecs;
    no paper is followed. Payload: the centring table `[lead, D]` and each plane, each zstd-compressed.
    """

    order: PlaneLayout = dataclasses.field(
        default="token-major", metadata={"help": "plane order: token-major (t, D) or channel-major (D, t)"}
    )
    level: int = dataclasses.field(default=3, metadata={"help": "zstd level (1..22)"})
    center: bool = dataclasses.field(
        default=True, metadata={"help": "subtract each head-channel's most frequent top byte"}
    )

    lossless = "bit-exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_level(self.level)
        if self.order not in PLANE_LAYOUTS:
            raise ValueError(f"order must be one of {list(PLANE_LAYOUTS)}, got {self.order!r}")

    def layout(self) -> str:
        return self.order

    def encode_chunk(self, chunk: torch.Tensor) -> bytes:
        planes = layouts.split_byte_planes(layouts.integer_view(chunk))  # [P, lead, t, D]
        modes = channel_modes(planes[0]) if self.center else np.zeros((chunk.shape[0], chunk.shape[2]), np.uint8)
        planes[0] -= modes[:, None, :]
        if self.order == "channel-major":
            planes = planes.transpose(0, 1, 3, 2)
        sections = [modes.tobytes()] + [np.ascontiguousarray(plane).tobytes() for plane in planes]
        return pack_sections([zstd_compress(section, self.level) for section in sections])

    def decode_chunk(self, payload: bytes | memoryview, shape: ChunkShape, dtype: torch.dtype) -> torch.Tensor:
        target = torch.empty(shape, dtype=dtype)
        self.decode_chunk_into(payload, target)
        return target

    def decode_chunk_into(self, payload: bytes | memoryview, target: torch.Tensor) -> None:
        lead, num_tokens, channels = target.shape
        sections = unpack_sections(payload, 1 + target.element_size())
        modes = np.frombuffer(zstd_decompress(sections[0], lead * channels), np.uint8).reshape(lead, channels)
        if not self.center and modes.any():
            raise CodecError("frame without centring carries a non-zero centring table")
        stored_shape = (lead, channels, num_tokens) if self.order == "channel-major" else tuple(target.shape)
        planes = [np.frombuffer(zstd_decompress(section, target.numel()), np.uint8).reshape(stored_shape)
                  for section in sections[1:]]
        if self.order == "channel-major":
            planes = [plane.transpose(0, 2, 1) for plane in planes]
        planes[0] = planes[0] + modes[:, None, :]
        layouts.join_byte_planes(planes, out=layouts.integer_view(target))


def channel_modes(plane: np.ndarray) -> np.ndarray:
    """Most frequent byte of each `(lead, channel)` over the tokens of a plane `[lead, t, D]` -> `[lead, D]`."""
    lead, _, channels = plane.shape
    modes = np.zeros((lead, channels), dtype=np.uint8)
    if plane.size == 0:
        return modes
    # Counting a sample of tokens instead loses most of the gain (1.193x -> 1.177x with 32 tokens).
    offsets = np.arange(channels, dtype=np.int64) * 256
    for row in range(lead):
        counts = np.bincount((plane[row] + offsets).reshape(-1), minlength=channels * 256)
        modes[row] = counts.reshape(channels, 256).argmax(axis=1)
    return modes
