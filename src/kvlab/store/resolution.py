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
import functools
import io
import struct
from typing import Any

import torch

from kvlab.codec import Codec, CodecError, ExpectedFrame, Lossless, StreamDecoder, codecs, create_codec
from kvlab.errors import ConfigError
from kvlab.timing import Stopwatch

_MAGIC = b"KVPC"
_HEADER = struct.Struct("<4sQ")
CHUNK_HEADER_BYTES = _HEADER.size


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
        nominal_bits_per_value: Stored bits per KV value of an fp32 model, metadata included: the
            fetcher's prior until it has measured the chunks it fetched.
        decode_values_per_s: KV values one decode worker restores per second, the prior of decode
            time (measured on 2 shared CPU cores; the fetcher replaces it with what it measures).
    """

    name: str
    codec: str
    params: tuple[tuple[str, Any], ...]
    quality: int
    nominal_bits_per_value: float
    decode_values_per_s: float

    @property
    def lossless(self) -> Lossless:
        return self.key_codec().lossless

    @property
    def decodes_by_token(self) -> bool:
        """Whether chunks restore token by token as they decode (video-coded codes)."""
        return bool(getattr(self.key_codec(), "decodes_by_token", False))

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
        if any(parameter.name == "kind" for parameter in codecs.parameters(self.codec)):
            params["kind"] = kind
        return create_codec(self.codec, **params)


RESOLUTIONS: dict[str, Resolution] = {
    resolution.name: resolution
    for resolution in (
        # The raw fp32 bytes: the "plain transfer" baseline of the prefix-reuse benchmark.
        Resolution("raw", "raw", (), quality=5, nominal_bits_per_value=32.0, decode_values_per_s=1e9),
        Resolution("exact", "byteplane", (), quality=5, nominal_bits_per_value=26.9, decode_values_per_s=1.6e8),
        *(
            Resolution(f"int{bits}", "quant_zstd", (("bits", bits),), quality=quality,
                       nominal_bits_per_value=bits_per_value, decode_values_per_s=1e8)
            for bits, quality, bits_per_value in ((8, 4, 8.2), (4, 3, 4.2))
        ),
        # KVCodec's operating point: low-bit codes coded by lossless HEVC (NVDEC where available).
        *(
            Resolution(f"int{bits}-video", "video_codes", (("bits", bits),), quality=bits - 1,
                       nominal_bits_per_value=bits_per_value, decode_values_per_s=1e7)
            for bits, bits_per_value in ((4, 4.9), (3, 3.9), (2, 2.9))
        ),
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


# Above the measured worst case: zstd's own worst-case expansion of incompressible input is 1/256
# plus a few bytes per 128 KiB block, so 1/64 plus 4 KiB leaves room to spare for any encoder run.
_WORST_CASE_MARGIN = 64
_WORST_CASE_SLACK_BYTES = 4096


@functools.lru_cache(maxsize=64)
def max_chunk_bytes(resolution: Resolution, geometry: ChunkGeometry) -> int:
    """Largest `encode_chunk` output for a chunk of `geometry` at `resolution`, plus a small margin.

    Measured once per (resolution, geometry) by encoding the worst case through the resolution's own
    codecs: a chunk of the geometry's shape and dtype holding incompressible values (random bit
    patterns for bit-exact codecs, uniform random values, whose codes are uniform, for quantizing
    ones). Any chunk of that geometry encodes to at most this, so a larger stored value cannot be
    one: readers refuse it before reading it (`KVStore.get(key, max_bytes)`).
    """
    generator = torch.Generator().manual_seed(0)
    shape = _chunk_shape(geometry)
    dtype = geometry.dtype or torch.float32
    tensors = []
    for _ in ("keys", "values"):
        if resolution.exact:
            width = torch.empty((), dtype=dtype).element_size() * 8
            bits = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), shape, generator=generator,
                                 dtype={16: torch.int16, 32: torch.int32}[width])
            tensors.append(bits.view(dtype))
        else:
            tensors.append((torch.rand(shape, generator=generator) * 2 - 1).to(dtype))
    worst = len(encode_chunk(resolution, *tensors))
    return worst + worst // _WORST_CASE_MARGIN + _WORST_CASE_SLACK_BYTES


def _chunk_shape(geometry: ChunkGeometry) -> tuple[int, int, int, int]:
    """[L, H_kv, t, D] of the geometry; one that names no model gets its whole size bound in one head."""
    if geometry.num_layers is not None and geometry.num_kv_heads is not None and geometry.head_dim is not None:
        return geometry.num_layers, geometry.num_kv_heads, geometry.num_tokens, geometry.head_dim
    element = torch.empty((), dtype=geometry.dtype or torch.float32).element_size()
    return 1, 1, geometry.num_tokens, max(1, geometry.max_bytes // (geometry.num_tokens * element))


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


@dataclasses.dataclass(frozen=True, slots=True)
class TokenRestore:
    """How one chunk was restored token by token.

    Attributes:
        peak_buffer_bytes: Most bytes held besides the output: the frame payload being decoded and
            the codec's own buffer (a few video frames and the quantization metadata).
        first_token_s: Seconds until the first token of the keys was restored.
        decode_s: Seconds until the last token of the values was restored.
    """

    peak_buffer_bytes: int
    first_token_s: float
    decode_s: float

    @property
    def restore_overlap(self) -> float:
        """Share of the decode during which restored tokens were already in place (0: chunk by chunk)."""
        return 1.0 - self.first_token_s / self.decode_s if self.decode_s > 0 else 0.0


def decode_chunk_by_token(
    resolution: Resolution, data: bytes | memoryview, geometry: ChunkGeometry | None = None,
) -> tuple[torch.Tensor, torch.Tensor, TokenRestore]:
    """`decode_chunk`, restoring each token as soon as it is decoded; with the buffer and timing it took.

    Codecs that do not decode token by token restore chunk by chunk here (their overlap is 0).
    """
    expected = None if geometry is None else geometry.expected_frame()
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise CodecError(f"stored chunk of {len(view)} bytes is shorter than its header")
    magic, key_length = _HEADER.unpack_from(view)
    if magic != _MAGIC or key_length > len(view) - _HEADER.size:
        raise CodecError("stored chunk has a bad header (not a kvlab prefix chunk, or truncated)")
    watch = Stopwatch()
    first: list[float] = []

    def on_token(restored: int, total: int) -> None:
        if not first:
            first.append(watch.elapsed())

    tensors, peak = [], 0
    for frame, codec in ((view[_HEADER.size : _HEADER.size + key_length], resolution.key_codec()),
                         (view[_HEADER.size + key_length :], resolution.value_codec())):
        decoder = StreamDecoder(io.BytesIO(frame), expected=expected)
        codec.check_header(decoder.header)
        tensors.append(decoder.restore(on_chunk=on_token, by_token=True))
        peak = max(peak, decoder.peak_buffer_bytes)
    if tensors[0].shape != tensors[1].shape:
        raise CodecError(f"stored chunk holds keys {tuple(tensors[0].shape)} but values {tuple(tensors[1].shape)}")
    elapsed = watch.elapsed()
    return tensors[0], tensors[1], TokenRestore(peak, first[0] if first else elapsed, elapsed)
