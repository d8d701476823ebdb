"""Chunk-by-chunk (or token-by-token) restoration of a frame from a stream, with a bounded buffer.

Only one chunk's payload and its decoded tensor are held at a time, so the buffer is bounded by the
largest chunk, not by the frame (KVCodec's fetcher; codecs that decode token by token restore each
token as it is decoded and hold a few video frames instead of a decoded chunk): for SmolLM2-135M's
30 layers, a 256-token fp16 chunk of keys is
2.9 MB decoded. Each chunk's checksum is verified before it is decoded; a stream that is corrupted
further on raises `CodecError` after the earlier chunks were restored.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import BinaryIO

import torch

from kvlab.codec import framing, layouts
from kvlab.codec.base import Codec, chunk_shapes, codecs
from kvlab.codec.errors import CodecError
from kvlab.errors import ConfigError

DEFAULT_MAX_CHUNK_BYTES = 64 << 20


def codec_for_header(header: framing.FrameHeader) -> Codec:
    """The codec a frame header names, built with the header's parameters and checked against it."""
    try:
        codec = codecs.create(header.codec, **header.params)
    except ConfigError as error:  # name and parameters come from untrusted bytes; the registry checks both
        raise CodecError(f"frame names a codec this kvlab cannot build: {error}") from error
    codec.check_header(header)
    return codec


class StreamDecoder:
    """Reads a frame's header from `source`, then restores its chunks one at a time.

    Args:
        source: A binary stream positioned at the start of a frame (a file, a socket file, BytesIO).
        max_chunk_bytes: Largest chunk payload accepted; bounds the buffer.
        expected: Shape, dtype and size of the restored tensor the caller accepts.

    Raises:
        CodecError: The header is invalid, is not what `expected` allows, or names a codec this
            kvlab cannot build.
    """

    def __init__(
        self,
        source: BinaryIO,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        expected: framing.ExpectedFrame | None = None,
    ) -> None:
        self._source = source
        self.max_chunk_bytes = max_chunk_bytes
        prefix = self._read_exact(framing.PREFIX.size, "frame prefix")
        header_length = framing.read_prefix(prefix)
        self.header = framing.parse_header(prefix, self._read_exact(header_length, "frame header"))
        (expected or framing.ExpectedFrame()).check(self.header)
        self.codec = codec_for_header(self.header)
        self.peak_buffer_bytes = 0
        largest = max(self.header.chunk_sizes, default=0)
        if largest > max_chunk_bytes:
            raise CodecError(f"frame has a chunk of {largest} bytes, above the {max_chunk_bytes}-byte buffer")

    def restore(
        self, out: torch.Tensor | None = None, on_chunk: Callable[[int, int], None] | None = None,
        by_token: bool = False,
    ) -> torch.Tensor:
        """Decode every chunk into `out` (allocated when None) and return it.

        Args:
            out: Contiguous tensor of the frame's shape and dtype to restore into.
            on_chunk: Called as `on_chunk(tokens_restored, total_tokens)` after each chunk (after each
                token with `by_token`).
            by_token: Restore each token as soon as it is decoded, for codecs that decode token by
                token (`QuantizedCodec.restore_by_token`): the buffer then holds a few video frames,
                not a decoded chunk. Other codecs restore chunk by chunk.

        Raises:
            ConfigError: `out` does not match the frame.
            CodecError: A chunk is truncated, corrupted or followed by extra bytes.
        """
        header = self.header
        if out is None:
            out = torch.empty(header.shape, dtype=header.dtype)
        elif tuple(out.shape) != header.shape or out.dtype != header.dtype or not out.is_contiguous():
            raise ConfigError(f"restore target must be a contiguous {header.dtype} tensor of shape {header.shape}")
        tokens = layouts.as_tokens(out)
        bounds = framing.chunk_bounds(tokens.shape[1], header.chunk_tokens)
        itemsize = out.element_size()
        for index, ((start, end), shape) in enumerate(zip(bounds, chunk_shapes(header), strict=True)):
            payload = self._read_exact(header.chunk_sizes[index], f"chunk {index}")
            framing.check_chunk(index, payload, header.chunk_crcs[index])
            restore_by_token = getattr(self.codec, "restore_by_token", None)
            if by_token and getattr(self.codec, "decodes_by_token", False) and restore_by_token is not None:
                on_token = (
                    None if on_chunk is None else functools.partial(_report_token, on_chunk, start, tokens.shape[1])
                )
                held = restore_by_token(payload, tokens[:, start:end], on_token)
            else:
                self.codec.decode_into([payload], [tokens[:, start:end]])
                held = math.prod(shape) * itemsize
                if on_chunk is not None:
                    on_chunk(end, tokens.shape[1])
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, len(payload) + held)
        if self._source.read(1):
            raise CodecError("extended frame: bytes follow the last chunk")
        return out

    def _read_exact(self, size: int, what: str) -> bytes:
        data = self._source.read(size)
        if data is None or len(data) != size:
            raise CodecError(f"truncated frame: the stream ends inside the {what}")
        return bytes(data)


def _report_token(on_chunk: Callable[[int, int], None], start: int, total: int, token: int) -> None:
    on_chunk(start + token + 1, total)
