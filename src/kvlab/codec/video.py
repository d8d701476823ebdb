"""`video`: KVCodec's codec-friendly layout, coded by a lossless video encoder through PyAV."""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch

from kvlab.codec import layouts, videoio
from kvlab.codec.base import ChunkShape, Codec, codecs
from kvlab.codec.errors import CodecError
from kvlab.codec.framing import pack_sections, unpack_sections
from kvlab.errors import KvlabError

Encoder = Literal["ffv1", "libx265"]
# Encoder -> its bitstream format; x265 runs at its fastest preset (every preset is lossless-exact here).
FORMAT_OF: dict[str, str] = {"ffv1": "ffv1", "libx265": "hevc"}


@codecs.register("video")
@dataclasses.dataclass
class VideoCodec(Codec):
    """Bit-exact: byte planes in the KVCodec frame layout, coded by a lossless video encoder.

    Paper: KVCodec (arXiv 2602.09725). Family: bit-exact codecs. Layout (`layouts.VideoGeometry`):
    consecutive tokens are consecutive frames, so inter-frame prediction sees each token's
    neighbour; inside a frame every head's channels fill their own 8x8-aligned tile, so no coding
    block mixes heads; the float's bytes are separate 8-bit planes stacked in the frame (8 bits fit
    every encoder's depth). Each chunk is its own video and decodes on its own.

    With `verify` (the default) every chunk is decoded once more while encoding and compared bit for
    bit, which costs about one decode per encode.

    Deviations from the paper: CPU encoders only (FFV1 and x265 `lossless=1`); NVENC/NVDEC are not
    wired in because no NVIDIA GPU was available to test them. No adaptive resolution: the tile
    layout is fixed, not chosen by the paper's joint optimization.
    """

    encoder: Encoder = dataclasses.field(default="ffv1", metadata={"help": "ffv1 or libx265 (lossless)"})
    verify: bool = dataclasses.field(
        default=True, metadata={"help": "decode each chunk after encoding it and fail unless it is bit-exact"}
    )

    lossless = "bit-exact"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.encoder not in FORMAT_OF:
            raise ValueError(f"encoder must be one of {list(FORMAT_OF)}, got {self.encoder!r}")
        self._backend = videoio.select_backend(FORMAT_OF[self.encoder], "never")

    def layout(self) -> str:
        return "kvcodec-frames"

    def encode_chunk(self, chunk: torch.Tensor) -> bytes:
        payload = self._encode_video(chunk)
        # Lossless modes are the encoder's promise, not ours: x265 broke it on narrow frames (see layouts).
        if self.verify:
            decoded = self.decode_chunk(payload, (chunk.shape[0], chunk.shape[1], chunk.shape[2]), chunk.dtype)
            if not np.array_equal(layouts.integer_view(decoded), layouts.integer_view(chunk)):
                raise KvlabError(f"{self.encoder} did not reproduce a chunk of shape {tuple(chunk.shape)} bit for bit")
        return payload

    def _encode_video(self, chunk: torch.Tensor) -> bytes:
        if chunk.numel() == 0:
            return pack_sections([])
        planes = layouts.split_byte_planes(layouts.integer_view(chunk))
        geometry = layouts.VideoGeometry(chunk.shape[0], chunk.shape[2], planes.shape[0])
        return pack_sections(videoio.encode_frames(layouts.to_video_frames(planes, geometry), self._backend))

    def decode_chunk(self, payload: bytes | memoryview, shape: ChunkShape, dtype: torch.dtype) -> torch.Tensor:
        sections = unpack_sections(payload)
        if shape[0] * shape[1] * shape[2] == 0:
            if sections:
                raise CodecError("an empty chunk carries video data")
            return torch.empty(shape, dtype=dtype)
        geometry = layouts.VideoGeometry(shape[0], shape[2], torch.empty(0, dtype=dtype).element_size())
        images = videoio.decode_frames(sections, FORMAT_OF[self.encoder], (shape[1], geometry.height, geometry.width))
        planes = layouts.from_video_frames(np.stack(list(images)), geometry)
        return layouts.from_integer_view(layouts.join_byte_planes(planes), dtype)
