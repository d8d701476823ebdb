"""KV codecs: bit-exact and code-lossless coding of KV tensors into checked, chunked frames.

`create_codec(name, **params)` builds a codec; `codec.encode(tensor) -> bytes` and
`codec.decode(data) -> tensor`; `codec.lossless` says what survives a round trip ("bit-exact" or
"codes"). `decode_frame(data)` decodes any frame by the codec named in its header, and
`StreamDecoder` restores a frame chunk by chunk from a file.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.codec import byteplane, cachegen, quant_zstd, raw, video, video_codes, zstd
from kvlab.codec.base import Codec, Lossless, codecs
from kvlab.codec.errors import CodecError
from kvlab.codec.framing import DEFAULT_MAX_DECODED_BYTES, ExpectedFrame, FrameHeader, read_frame
from kvlab.codec.streaming import StreamDecoder, codec_for_header

__all__ = [
    "DEFAULT_MAX_DECODED_BYTES",
    "Codec",
    "CodecError",
    "ExpectedFrame",
    "FrameHeader",
    "Lossless",
    "StreamDecoder",
    "available_codecs",
    "codecs",
    "create_codec",
    "decode_frame",
    "read_header",
]

_MODULES = (byteplane, cachegen, quant_zstd, raw, video, video_codes, zstd)


def available_codecs() -> list[str]:
    """Names of every registered codec, sorted."""
    return codecs.names()


def create_codec(name: str, **params: Any) -> Codec:
    """The codec `name` with `params` (unknown names or bad parameters raise `ConfigError`)."""
    return codecs.create(name, **params)


def read_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """The validated header of a whole frame (checksums included)."""
    return read_frame(data)[0]


def decode_frame(data: bytes | bytearray | memoryview, expected: ExpectedFrame | None = None) -> torch.Tensor:
    """Decode a frame with the codec and parameters its header names, if `expected` (default: any
    tensor up to `DEFAULT_MAX_DECODED_BYTES`) allows what the header describes."""
    header = read_header(data)
    (expected or ExpectedFrame()).check(header)
    return codec_for_header(header).decode(data, expected)

