"""Resolutions a prefix chunk is stored at, and a chunk's byte format.

A stored chunk is the keys and values of every layer for `chunk_tokens` tokens, `[L, H_kv, t, D]`
each, encoded by one codec pair. Several resolutions of the same chunk may sit side by side under
different keys (the resolution is part of the key's fingerprint): the fetcher picks one per chunk.

Byte format of a stored chunk: magic `KVPC`, the keys frame's length (u64 little-endian), the keys
frame, the values frame. Each frame carries its own checksums (`kvlab.codec.framing`), so a corrupted
chunk is detected and raises `CodecError`. Decoding checks each frame against the `ChunkGeometry` the
reader's model needs before anything is allocated (`kvlab.store.auth` adds authentication on top).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import torch

from kvlab.codec import Codec, CodecError, ExpectedFrame, Lossless, create_codec
from kvlab.errors import ConfigError

_MAGIC = b"KVPC"
_HEADER = struct.Struct("<4sQ")


@dataclasses.dataclass(frozen=True)
class ChunkGeometry:
    """What the keys and the values `[L, H_kv, t, D]` of one stored chunk must be for the reading model.

    Attributes:
        num_tokens: Tokens per chunk (`t`).
        max_bytes: Largest decoded tensor (keys or values) accepted, in bytes.
        num_layers: `L`, or None when the reader does not know its model.
        num_kv_heads: `H_kv`, or None.
        head_dim: `D`, or None.
        dtype: The model's KV dtype, or None for any float dtype.
    """

    num_tokens: int
    max_bytes: int
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    dtype: torch.dtype | None = None

    def expected_frame(self) -> ExpectedFrame:
        shape = (self.num_layers, self.num_kv_heads, self.num_tokens, self.head_dim)
        return ExpectedFrame(shape=shape, dtype=self.dtype, max_bytes=self.max_bytes)


@dataclasses.dataclass(frozen=True)
class Resolution:
    """One way of storing a chunk.

    Attributes:
        name: What users and keys call it.
        codec: Registered codec name.
        params: Codec parameters shared by keys and values (`kind` is set per tensor).
        quality: Higher is closer to the original; the fetcher prefers it when time allows.
        nominal_ratio: fp32 bytes over stored bytes, a prior until sizes are measured.
    """

    name: str
    codec: str
    params: tuple[tuple[str, Any], ...]
    quality: int
    nominal_ratio: float

    @property
    def lossless(self) -> Lossless:
        return self.key_codec().lossless

    @property
    def exact(self) -> bool:
        """The restored KV has the original bits (output identical to recompute)."""
        return self.lossless == "bit-exact"

    def describe(self) -> dict[str, Any]:
        return {"codec": self.codec, **dict(self.params)}

    def key_codec(self) -> Codec:
        return self._codec("keys")

    def value_codec(self) -> Codec:
        return self._codec("values")

    def _codec(self, kind: str) -> Codec:
        params = dict(self.params)
        if self.codec == "quant_zstd":
            params["kind"] = kind
        return create_codec(self.codec, **params)


RESOLUTIONS: dict[str, Resolution] = {
    resolution.name: resolution
    for resolution in (
        # The raw fp32 bytes: the "plain transfer" baseline of the prefix-reuse benchmark.
        Resolution("raw", "raw", (), quality=3, nominal_ratio=1.0),
        Resolution("exact", "byteplane", (), quality=3, nominal_ratio=1.19),
        Resolution("int8", "quant_zstd", (("bits", 8),), quality=2, nominal_ratio=3.9),
        Resolution("int4", "quant_zstd", (("bits", 4),), quality=1, nominal_ratio=7.6),
    )
}


def exact_resolutions() -> tuple[str, ...]:
    """Resolutions whose restored KV has the original bits (the only ones a verifier may read)."""
    return tuple(name for name, resolution in RESOLUTIONS.items() if resolution.exact)


def get_resolution(name: str) -> Resolution:
    try:
        return RESOLUTIONS[name]
    except KeyError:
        raise ConfigError(f"unknown resolution {name!r}; choose from: {', '.join(RESOLUTIONS)}") from None


def encode_chunk(resolution: Resolution, keys: torch.Tensor, values: torch.Tensor) -> bytes:
    """Bytes of one chunk: `keys` and `values` `[L, H_kv, t, D]`."""
    key_frame = resolution.key_codec().encode(keys)
    value_frame = resolution.value_codec().encode(values)
    return _HEADER.pack(_MAGIC, len(key_frame)) + key_frame + value_frame


def decode_chunk(
    resolution: Resolution, data: bytes | memoryview, geometry: ChunkGeometry | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of a chunk `encode_chunk` wrote; `CodecError` for anything else, including
    frames that are not the shape, dtype and size `geometry` (when given) allows."""
    expected = None if geometry is None else geometry.expected_frame()
    key_frame, value_frame = split_chunk(data)
    keys = resolution.key_codec().decode(key_frame, expected)
    values = resolution.value_codec().decode(value_frame, expected)
    if keys.shape != values.shape:
        raise CodecError(f"stored chunk holds keys {tuple(keys.shape)} but values {tuple(values.shape)}")
    return keys, values


def split_chunk(data: bytes | memoryview) -> tuple[memoryview, memoryview]:
    """The key frame and the value frame of a chunk `encode_chunk` wrote (each names its own codec).

    Raises:
        CodecError: The bytes do not start with a prefix chunk's header, or are truncated.
    """
    if len(data) < _HEADER.size:
        raise CodecError(f"stored chunk of {len(data)} bytes is shorter than its header")
    magic, key_length = _HEADER.unpack_from(data)
    if magic != _MAGIC or key_length > len(data) - _HEADER.size:
        raise CodecError("stored chunk has a bad header (not a kvlab prefix chunk, or truncated)")
    view = memoryview(data)
    return view[_HEADER.size : _HEADER.size + key_length], view[_HEADER.size + key_length :]
