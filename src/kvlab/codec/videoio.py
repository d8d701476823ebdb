"""Lossless video coding of uint8 frames through PyAV: which encoder runs, and the encode/decode loops.

A video is a list of sections: the encoder's extradata, then one section per packet; the caller
records the pixel format the frames were coded in (`encode_frames` returns it). The bitstream format (FFV1
or HEVC) is a codec parameter; which implementation codes it is chosen here at run time: NVIDIA's
NVENC/NVDEC when `hardware` allows it and this PyAV build and machine have them, else the CPU
(libx265, FFV1). Any decoder of the format reads what any encoder of it wrote.

Frames are `[height, width]` uint8 images. Hardware encoders take no grayscale input, so they code
the image as the luma plane of a 4:4:4 frame whose chroma planes are zero (nearly free after
prediction); the recorded pixel format tells the decoder which plane to read back.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from types import ModuleType
from typing import Any, Literal

import numpy as np

from kvlab.codec.errors import CodecError
from kvlab.errors import ConfigError

VideoFormat = Literal["ffv1", "hevc"]
Hardware = Literal["auto", "never"]
FORMATS: tuple[str, ...] = ("ffv1", "hevc")
HARDWARE: tuple[str, ...] = ("auto", "never")
PIXEL_FORMATS: tuple[str, ...] = ("gray", "yuv444p")


@dataclasses.dataclass(frozen=True)
class VideoBackend:
    """One implementation of a bitstream format: libav encoder and decoder names, pixel format, options."""

    format: str
    encoder: str
    decoder: str
    pixel_format: str
    options: tuple[tuple[str, str], ...]
    hardware: bool


SOFTWARE: dict[str, VideoBackend] = {
    "ffv1": VideoBackend("ffv1", "ffv1", "ffv1", "gray", (("level", "3"), ("slicecrc", "0")), False),
    # x265 single-threaded (no worker pool, one frame thread): with its default threads it crashed the test
    # process (a segmentation fault inside `encode`) twice in about 17 runs of the suite. Whether the threads
    # also cause the wrong pixels `video_codes` retries (seen with one frame thread, the pool on) is not known.
    # A chunk's frames are small (80x72 pixels for SmolLM2).
    "hevc": VideoBackend(
        "hevc", "libx265", "hevc", "gray",
        (("x265-params", "lossless=1:log-level=none:pools=none:frame-threads=1"), ("preset", "ultrafast")), False,
    ),
}
# FFV1 has no hardware implementation; NVENC's lossless HEVC needs 4:4:4 input (no grayscale).
HARDWARE_BACKENDS: dict[str, VideoBackend] = {
    "hevc": VideoBackend("hevc", "hevc_nvenc", "hevc_cuvid", "yuv444p", (("tune", "lossless"), ("preset", "p4")), True),
}


def require_av() -> ModuleType:
    """The `av` module, or a ConfigError saying how to install it."""
    try:
        return importlib.import_module("av")
    except ImportError:
        raise ConfigError("the video codecs need PyAV: pip install 'av>=12'") from None


@functools.cache
def has_codec(name: str, mode: str) -> bool:
    """Whether this PyAV build has the encoder (`mode="w"`) or decoder (`"r"`) `name`, and it opens."""
    av = require_av()
    try:
        av.codec.Codec(name, mode)
    except Exception:  # PyAV raises different types for unknown and unusable codecs
        return False
    return True


@functools.cache
def hardware_works(backend: VideoBackend) -> bool:
    """Whether `backend` really encodes here: NVENC is listed by builds that have it even without a GPU."""
    if not (has_codec(backend.encoder, "w") and has_codec(backend.decoder, "r")):
        return False
    try:
        encode_frames(np.zeros((1, 64, 64), dtype=np.uint8), backend)
    except Exception:  # no device, no driver or no session: fall back to the CPU
        return False
    return True


def select_backend(
    video_format: str, hardware: str, usable: Callable[[VideoBackend], bool] = hardware_works
) -> VideoBackend:
    """The backend that encodes `video_format`: hardware when allowed and `usable`, else software.

    Raises:
        ConfigError: The format or hardware choice is unknown, or this PyAV build cannot code it.
    """
    require_av()
    if video_format not in SOFTWARE:
        raise ConfigError(f"video format must be one of {list(FORMATS)}, got {video_format!r}")
    if hardware not in HARDWARE:
        raise ConfigError(f"hardware must be one of {list(HARDWARE)}, got {hardware!r}")
    candidate = HARDWARE_BACKENDS.get(video_format)
    if hardware == "auto" and candidate is not None and usable(candidate):
        return candidate
    software = SOFTWARE[video_format]
    for name, mode in ((software.encoder, "w"), (software.decoder, "r")):
        if not has_codec(name, mode):
            raise ConfigError(f"this PyAV build has no {name!r} {'encoder' if mode == 'w' else 'decoder'}")
    return software


def decoder_for(video_format: str, pixel_format: str, hardware: str,
                usable: Callable[[VideoBackend], bool] = hardware_works) -> str:
    """The libav decoder for a stream of `video_format` coded in `pixel_format`."""
    candidate = HARDWARE_BACKENDS.get(video_format)
    # NVDEC reads the 4:4:4 streams NVENC writes; x265's grayscale streams stay on the CPU.
    if hardware == "auto" and candidate is not None and pixel_format == candidate.pixel_format and usable(candidate):
        return candidate.decoder
    return SOFTWARE[video_format].decoder


def encode_frames(frames: np.ndarray, backend: VideoBackend) -> list[bytes]:
    """Sections of one video holding `frames` `[T, height, width]` uint8, in `backend.pixel_format`."""
    av = require_av()
    height, width = frames.shape[1:]
    context: Any = av.CodecContext.create(backend.encoder, "w")
    context.width, context.height, context.pix_fmt = width, height, backend.pixel_format
    context.time_base, context.framerate = Fraction(1, 25), Fraction(25, 1)
    context.options = dict(backend.options)
    packets: list[bytes] = []
    for index, image in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(_to_pixels(image, backend.pixel_format), format=backend.pixel_format)
        frame.pts = index
        packets += [bytes(packet) for packet in context.encode(frame)]
    packets += [bytes(packet) for packet in context.encode(None)]
    return [bytes(context.extradata or b""), *packets]


def decode_frames(
    sections: Sequence[bytes | memoryview], video_format: str, shape: tuple[int, int, int],
    pixel_format: str = "gray", hardware: str = "never",
) -> Iterator[np.ndarray]:
    """The `[height, width]` uint8 frames of a video `encode_frames` wrote, one at a time.

    Args:
        sections: The video's sections.
        video_format: Its bitstream format.
        shape: `(num_frames, height, width)` the caller expects; anything else is a `CodecError`.
        pixel_format: What the encoder coded the frames in (one of `PIXEL_FORMATS`).
        hardware: "auto" lets NVDEC decode the streams NVENC wrote.
    """
    num_frames, height, width = shape
    if not sections:
        raise CodecError("video chunk has no extradata section")
    if pixel_format not in PIXEL_FORMATS:
        raise CodecError(f"video chunk names pixel format {pixel_format!r}, not one of {list(PIXEL_FORMATS)}")
    av = require_av()
    context: Any = av.CodecContext.create(decoder_for(video_format, pixel_format, hardware), "r")
    context.width, context.height, context.pix_fmt = width, height, pixel_format
    if len(sections[0]):
        context.extradata = bytes(sections[0])
    count = 0
    for packet in [av.Packet(bytes(section)) for section in sections[1:]] + [None]:
        for frame in context.decode(packet):
            count += 1
            if count > num_frames:
                raise CodecError(f"video chunk holds more than its {num_frames} frames")
            yield _checked_image(frame, pixel_format, height, width)
    if count != num_frames:
        raise CodecError(f"video chunk decoded to {count} frames, expected {num_frames}")


def _to_pixels(image: np.ndarray, pixel_format: str) -> np.ndarray:
    if pixel_format == "gray":
        return image
    planes = np.zeros((3, *image.shape), dtype=np.uint8)
    planes[0] = image
    return planes


def _checked_image(frame: Any, pixel_format: str, height: int, width: int) -> np.ndarray:
    if frame.format.name != pixel_format:
        raise CodecError(f"decoded frame is {frame.format.name}, the stream declared {pixel_format}")
    # Plane 0 is the image in both formats (the luma plane of 4:4:4 frames).
    plane = frame.planes[0]
    if (plane.height, plane.width) != (height, width):
        raise CodecError(f"decoded frame is {plane.height}x{plane.width}, expected {height}x{width}")
    rows = np.frombuffer(memoryview(plane), dtype=np.uint8).reshape(height, plane.line_size)
    return rows[:, :width].copy()
