"""The frame every codec writes: a checksummed header, then one payload per token chunk.

Layout (little-endian)::

    prefix   magic b"KVLC" | u16 format version | u32 header length (bytes after the prefix)
    header   u8 len + codec name | u8 len + layout | u32 len + params as JSON | u8 dtype code
             | u8 ndim + ndim x u64 shape | u32 chunk tokens | u32 number of chunks
             | per chunk: u64 payload bytes + u32 crc32 of the payload | u32 crc32 of prefix + header
    payloads the chunks' bytes, back to back, nothing after them

The header checksum covers the chunk table, so every byte of a frame is covered by some checksum.
Checksums catch accidents, not intent: a frame from an untrusted source is parsed with every count
bounded by the bytes actually present (chunk counts are computed, never enumerated), and a caller
that knows what it expects (`ExpectedFrame`) rejects any other shape, dtype or size before anything
is allocated for the decoded tensor. JSON holds the parameters because it is data, never code (no
pickle anywhere).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from kvlab.codec.errors import CodecError
from kvlab.codec.layouts import token_geometry

MAGIC = b"KVLC"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<4sHI")
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
MAX_NDIM = 8
MAX_HEADER_BYTES = 1 << 26
# Far above any KV cache, far below what a corrupted size field could ask a decoder to allocate.
MAX_ELEMENTS = 1 << 40
# What a decoder allocates for a frame when its caller states no tighter bound.
DEFAULT_MAX_DECODED_BYTES = 1 << 30
# Codec parameters are a handful of scalars; anything longer is not a frame this kvlab wrote.
MAX_PARAMS_BYTES = 4096
_NAME = re.compile(r"[a-z0-9_]{1,64}")
_LAYOUT = re.compile(r"[a-z0-9_\-]{1,64}")
_CHUNK_ENTRY = struct.Struct("<QI")


@dataclasses.dataclass(frozen=True)
class FrameHeader:
    """What a frame says about itself; every field is validated when parsed."""

    codec: str
    layout: str
    params: dict[str, Any]
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunk_tokens: int
    chunk_sizes: tuple[int, ...]
    chunk_crcs: tuple[int, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_sizes)

    @property
    def payload_bytes(self) -> int:
        return sum(self.chunk_sizes)

    @property
    def decoded_bytes(self) -> int:
        """Bytes of the tensor the frame decodes to."""
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


@dataclasses.dataclass(frozen=True)
class ExpectedFrame:
    """What a caller accepts from an untrusted frame, checked before the decoded tensor is allocated.

    Attributes:
        shape: The exact shape, or None for any; a None entry accepts any size on that axis.
        dtype: The exact dtype, or None for any float dtype.
        max_bytes: Largest decoded tensor, in bytes.
    """

    shape: tuple[int | None, ...] | None = None
    dtype: torch.dtype | None = None
    max_bytes: int = DEFAULT_MAX_DECODED_BYTES

    def check(self, header: FrameHeader) -> None:
        """Raise `CodecError` unless `header` describes a tensor this caller accepts."""
        if self.shape is not None and (
            len(header.shape) != len(self.shape)
            or any(want is not None and got != want for got, want in zip(header.shape, self.shape, strict=True))
        ):
            wanted = ", ".join("*" if size is None else str(size) for size in self.shape)
            raise CodecError(f"frame holds shape {list(header.shape)}, expected [{wanted}]")
        if self.dtype is not None and header.dtype != self.dtype:
            raise CodecError(f"frame holds {header.dtype}, expected {self.dtype}")
        if header.decoded_bytes > self.max_bytes:
            raise CodecError(f"frame decodes to {header.decoded_bytes} bytes, above the limit of {self.max_bytes}")


def num_chunks_for(num_tokens: int, chunk_tokens: int) -> int:
    """How many chunks cover `num_tokens` tokens (arithmetic: a hostile size never builds a list)."""
    return -(-num_tokens // chunk_tokens)


def chunk_bounds(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) token ranges of consecutive chunks covering `num_tokens` tokens."""
    return [(start, min(start + chunk_tokens, num_tokens)) for start in range(0, num_tokens, chunk_tokens)]


def write_frame(
    codec: str,
    layout: str,
    params: dict[str, Any],
    dtype: torch.dtype,
    shape: Sequence[int],
    chunk_tokens: int,
    payloads: Sequence[bytes],
) -> bytes:
    """Frame bytes for chunk payloads produced by `codec` from a tensor of `dtype` and `shape`."""
    body = bytearray()
    for text in (codec, layout):
        encoded = text.encode("ascii")
        body += struct.pack("<B", len(encoded)) + encoded
    params_json = json.dumps(params, sort_keys=True, separators=(",", ":")).encode("utf-8")
    body += struct.pack("<I", len(params_json)) + params_json
    body += struct.pack("<BB", DTYPE_CODES[dtype], len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
    body += struct.pack("<II", chunk_tokens, len(payloads))
    for payload in payloads:
        body += _CHUNK_ENTRY.pack(len(payload), zlib.crc32(payload))
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, len(body) + 4)
    header_crc = zlib.crc32(body, zlib.crc32(prefix))
    return b"".join([prefix, bytes(body), struct.pack("<I", header_crc), *payloads])


def read_prefix(prefix: bytes) -> int:
    """Check magic and version of the first `PREFIX.size` bytes; returns the header length."""
    if len(prefix) < PREFIX.size:
        raise CodecError(f"truncated frame: {len(prefix)} bytes, a frame starts with {PREFIX.size}")
    magic, version, header_length = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise CodecError(f"not a kvlab codec frame (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported frame format version {version} (this kvlab reads {FORMAT_VERSION})")
    if not 4 <= header_length <= MAX_HEADER_BYTES:
        raise CodecError(f"implausible header length {header_length}")
    return int(header_length)


def parse_header(prefix: bytes, header: bytes) -> FrameHeader:
    """Validate the checksum and every field of a header read after `prefix`."""
    body, stored_crc = header[:-4], struct.unpack("<I", header[-4:])[0]
    if zlib.crc32(body, zlib.crc32(prefix[: PREFIX.size])) != stored_crc:
        raise CodecError("frame header checksum mismatch (corrupted header)")
    reader = _Reader(body)
    codec = reader.text(_NAME, "codec name")
    layout = reader.text(_LAYOUT, "layout")
    params = _parse_params(reader.take(reader.unpack("<I")[0]))
    dtype_code, ndim = reader.unpack("<BB")
    if dtype_code not in CODE_DTYPES:
        raise CodecError(f"unknown dtype code {dtype_code}")
    if ndim > MAX_NDIM:
        raise CodecError(f"frame claims {ndim} dimensions (at most {MAX_NDIM})")
    shape = tuple(int(size) for size in reader.unpack(f"<{ndim}Q"))
    if math.prod(shape) > MAX_ELEMENTS or any(size > MAX_ELEMENTS for size in shape):
        raise CodecError(f"implausible shape {shape}")
    chunk_tokens, num_chunks = reader.unpack("<II")
    if chunk_tokens < 1:
        raise CodecError("frame claims chunks of 0 tokens")
    expected_chunks = num_chunks_for(token_geometry(shape)[1], chunk_tokens)
    if num_chunks != expected_chunks:
        raise CodecError(f"frame lists {num_chunks} chunks, its shape needs {expected_chunks}")
    if num_chunks * _CHUNK_ENTRY.size > reader.remaining:
        raise CodecError(f"truncated frame: {num_chunks} chunks listed, the header holds "
                         f"{reader.remaining // _CHUNK_ENTRY.size}")
    entries = [_CHUNK_ENTRY.unpack(reader.take(_CHUNK_ENTRY.size)) for _ in range(num_chunks)]
    if not reader.at_end():
        raise CodecError("frame header has trailing bytes")
    return FrameHeader(
        codec=codec,
        layout=layout,
        params=params,
        dtype=CODE_DTYPES[dtype_code],
        shape=shape,
        chunk_tokens=chunk_tokens,
        chunk_sizes=tuple(int(size) for size, _ in entries),
        chunk_crcs=tuple(int(crc) for _, crc in entries),
    )


def read_frame(data: bytes | bytearray | memoryview) -> tuple[FrameHeader, list[memoryview]]:
    """Parse a whole frame: the header and each chunk's payload, all sizes and checksums checked."""
    view = memoryview(data).cast("B")
    header_length = read_prefix(bytes(view[: PREFIX.size]))
    header_end = PREFIX.size + header_length
    if len(view) < header_end:
        raise CodecError(f"truncated frame: {len(view)} bytes, the header alone needs {header_end}")
    header = parse_header(bytes(view[: PREFIX.size]), bytes(view[PREFIX.size : header_end]))
    payload_length = len(view) - header_end
    if payload_length != header.payload_bytes:
        change = "truncated" if payload_length < header.payload_bytes else "extended"
        raise CodecError(f"{change} frame: {payload_length} payload bytes, header lists {header.payload_bytes}")
    payloads, offset = [], header_end
    for index, (size, crc) in enumerate(zip(header.chunk_sizes, header.chunk_crcs, strict=True)):
        payload = view[offset : offset + size]
        check_chunk(index, payload, crc)
        payloads.append(payload)
        offset += size
    return header, payloads


def check_chunk(index: int, payload: bytes | memoryview, crc: int) -> None:
    if zlib.crc32(payload) != crc:
        raise CodecError(f"chunk {index} checksum mismatch (corrupted payload)")


def pack_sections(sections: Sequence[bytes]) -> bytes:
    """Several byte strings as one payload: u32 count, u64 length of each, then the bytes."""
    lengths = struct.pack(f"<I{len(sections)}Q", len(sections), *(len(section) for section in sections))
    return lengths + b"".join(sections)


def unpack_sections(payload: bytes | memoryview, count: int | None = None) -> list[memoryview]:
    """Inverse of `pack_sections`; `count` (when given) is the number of sections the caller expects."""
    reader = _Reader(memoryview(payload).cast("B"))
    (found,) = reader.unpack("<I")
    if count is not None and found != count:
        raise CodecError(f"payload has {found} sections, expected {count}")
    if 8 * found > len(payload):
        raise CodecError(f"payload claims {found} sections in {len(payload)} bytes")
    lengths = reader.unpack(f"<{found}Q")
    sections = [reader.take(length) for length in lengths]
    if not reader.at_end():
        raise CodecError("payload has trailing bytes")
    return sections


def _parse_params(raw: memoryview) -> dict[str, Any]:
    if len(raw) > MAX_PARAMS_BYTES:
        raise CodecError(f"frame parameters take {len(raw)} bytes (at most {MAX_PARAMS_BYTES})")
    try:
        params = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        # Nesting deep enough to exhaust the parser's recursion is hostile, not a codec's parameters.
        raise CodecError(f"frame parameters are not valid JSON ({type(error).__name__})") from None
    scalar = (str, int, float, bool, type(None))
    if not isinstance(params, dict) or not all(isinstance(v, scalar) for v in params.values()):
        raise CodecError("frame parameters must be a JSON object of scalars")
    return params


class _Reader:
    """Bounds-checked sequential reads; running past the end is a truncated frame."""

    def __init__(self, data: bytes | memoryview) -> None:
        self._data = memoryview(data).cast("B")
        self._offset = 0

    def take(self, size: int) -> memoryview:
        if size > len(self._data) - self._offset:
            raise CodecError(f"truncated frame: needs {size} more bytes at offset {self._offset}")
        chunk = self._data[self._offset : self._offset + size]
        self._offset += size
        return chunk

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        layout = struct.Struct(fmt)
        return layout.unpack(self.take(layout.size))

    def text(self, pattern: re.Pattern[str], what: str) -> str:
        raw = bytes(self.take(self.unpack("<B")[0]))
        text = raw.decode("ascii", errors="replace")
        if not pattern.fullmatch(text):
            raise CodecError(f"invalid {what} {raw!r} in frame header")
        return text

    @property
    def remaining(self) -> int:
        return len(self._data) - self._offset

    def at_end(self) -> bool:
        return self._offset == len(self._data)
