"""`video`: KVCodec's codec-friendly layout, coded by a lossless video encoder through PyAV."""

from __future__ import annotations

import dataclasses
import importlib
from fractions import Fraction
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch

from kvlab.codec import layouts
from kvlab.codec.base import ChunkShape, Codec, codecs
from kvlab.codec.errors import CodecError
from kvlab.codec.framing import pack_sections, unpack_sections
from kvlab.errors import ConfigError, KvlabError

Encoder = Literal["ffv1", "libx265"]
# Encoder -> (decoder, options that make it lossless and quiet).
ENCODERS: dict[str, tuple[str, dict[str, str]]] = {
    "ffv1": ("ffv1", {"level": "3", "slicecrc": "0"}),
    "libx265": ("hevc", {"x265-params": "lossless=1:log-level=none", "preset": "ultrafast"}),
}
PIXEL_FORMAT = "gray"


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
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {list(ENCODERS)}, got {self.encoder!r}")
        av = require_av()
        for name, mode in ((self.encoder, "w"), (ENCODERS[self.encoder][0], "r")):
            try:
                av.codec.Codec(name, mode)
            except Exception as error:
                raise ConfigError(f"this PyAV build has no {name!r} {'encoder' if mode == 'w' else 'decoder'}") \
                    from error

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
        frames = layouts.to_video_frames(planes, geometry)
        av = require_av()
        context: Any = av.CodecContext.create(self.encoder, "w")
        context.width, context.height, context.pix_fmt = geometry.width, geometry.height, PIXEL_FORMAT
        context.time_base, context.framerate = Fraction(1, 25), Fraction(25, 1)
        context.options = dict(ENCODERS[self.encoder][1])
        packets: list[bytes] = []
        for index, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(image, format=PIXEL_FORMAT)
            frame.pts = index
            packets += [bytes(packet) for packet in context.encode(frame)]
        packets += [bytes(packet) for packet in context.encode(None)]
        return pack_sections([bytes(context.extradata or b""), *packets])

    def decode_chunk(self, payload: bytes | memoryview, shape: ChunkShape, dtype: torch.dtype) -> torch.Tensor:
        sections = unpack_sections(payload)
        num_planes = torch.empty(0, dtype=dtype).element_size()
        if shape[0] * shape[1] * shape[2] == 0:
            if sections:
                raise CodecError("an empty chunk carries video data")
            return torch.empty(shape, dtype=dtype)
        if not sections:
            raise CodecError("video chunk has no extradata section")
        geometry = layouts.VideoGeometry(shape[0], shape[2], num_planes)
        av = require_av()
        context: Any = av.CodecContext.create(ENCODERS[self.encoder][0], "r")
        context.width, context.height, context.pix_fmt = geometry.width, geometry.height, PIXEL_FORMAT
        if len(sections[0]):
            context.extradata = bytes(sections[0])
        images = []
        for packet in [av.Packet(bytes(section)) for section in sections[1:]] + [None]:
            for frame in context.decode(packet):
                images.append(_checked_image(frame.to_ndarray(), geometry))
                if len(images) > shape[1]:
                    raise CodecError(f"video chunk holds more than its {shape[1]} frames")
        if len(images) != shape[1]:
            raise CodecError(f"video chunk decoded to {len(images)} frames, expected {shape[1]}")
        planes = layouts.from_video_frames(np.stack(images), geometry)
        return layouts.from_integer_view(layouts.join_byte_planes(planes), dtype)


def require_av() -> ModuleType:
    """The `av` module, or a ConfigError saying how to install it."""
    try:
        return importlib.import_module("av")
    except ImportError:
        raise ConfigError("the video codec needs PyAV: pip install 'av>=12'") from None


def _checked_image(image: np.ndarray, geometry: layouts.VideoGeometry) -> np.ndarray:
    if image.shape != (geometry.height, geometry.width) or image.dtype != np.uint8:
        raise CodecError(f"decoded frame {image.shape} {image.dtype}, expected ({geometry.height}, {geometry.width}) uint8")
    return image
