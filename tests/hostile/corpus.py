"""The hostile corpus: stored values and codec frames an attacker with write access to a store can plant.

Built by code, deterministically, from a genuine chunk (so every value is as close to real as the
attack allows) with a frame writer of its own: these bytes must be able to break every rule the
kvlab frame writer keeps (checksums stay valid, so only the parser's own checks stand in the way).

Frame-level cases (`hostile_frames`) are what `kvlab codec decode` must refuse. Chunk-level cases
(`hostile_chunks`) are stored values: the frame cases wrapped as a chunk, plus valid frames of the
wrong model (foreign geometry, fewer layers, other dtype) and NaN, which only a reader that knows
its model can refuse. A swapped chunk (another prompt's authentic value) is built by the tests,
which hold a second prompt.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator

import torch
import zstandard

from kvlab.codec import Codec
from kvlab.codec.framing import DTYPE_CODES, FORMAT_VERSION, MAGIC, pack_sections
from kvlab.store.resolution import RESOLUTIONS, encode_chunk

BOMB_BYTES = 512 << 20
"""What each zstd bomb inflates to."""
TWO_TIB = 2 << 40

# Cases every reader must refuse, whatever it expects: malformed or oversized frames.
MALFORMED = ("declared_2tib_shape", "chunk_table_bomb", "json_nesting", "json_too_long", "zstd_bomb_declared",
             "zstd_bomb_undeclared", "truncated_frame")
# Valid frames that only a reader knowing its model refuses.
FOREIGN = ("foreign_kv_heads", "foreign_head_dim", "fewer_layers", "other_dtype", "nan_values", "inf_values")


def raw_frame(
    codec: Codec,
    shape: tuple[int, ...],
    payloads: list[bytes],
    dtype: torch.dtype = torch.float32,
    params_json: bytes | None = None,
    chunk_tokens: int | None = None,
    num_chunks: int | None = None,
) -> bytes:
    """A frame with any field chosen by the caller, checksums computed as a genuine writer would."""
    body = bytearray()
    for text in (codec.name, codec.layout()):
        body += struct.pack("<B", len(text)) + text.encode()
    params = params_json if params_json is not None else _json(codec.params())
    body += struct.pack("<I", len(params)) + params
    body += struct.pack("<BB", DTYPE_CODES[dtype], len(shape)) + struct.pack(f"<{len(shape)}Q", *shape)
    body += struct.pack("<II", chunk_tokens or codec.chunk_tokens, len(payloads) if num_chunks is None else num_chunks)
    for payload in payloads:
        body += struct.pack("<QI", len(payload), zlib.crc32(payload))
    prefix = struct.pack("<4sHI", MAGIC, FORMAT_VERSION, len(body) + 4)
    return prefix + bytes(body) + struct.pack("<I", zlib.crc32(body, zlib.crc32(prefix))) + b"".join(payloads)


def hostile_frames(shape: tuple[int, int, int, int]) -> dict[str, bytes]:
    """Malformed keys frames for the "exact" resolution's codec, for a chunk of `shape` `[L, H_kv, t, D]` fp32."""
    codec = RESOLUTIONS["exact"].key_codec()
    layers, heads, tokens, channels = shape
    genuine = codec.encode(torch.randn(shape))
    lead = layers * heads

    def bomb_payload(declare: bool) -> bytes:
        plane = zstd_bomb(BOMB_BYTES, declare)
        modes = zstandard.ZstdCompressor().compress(bytes(lead * channels))
        other = zstandard.ZstdCompressor().compress(bytes(lead * tokens * channels))
        return pack_sections([modes, plane, other, other, other])

    return {
        # 2 TiB of fp32 in a frame of a hundred bytes: an empty payload, every checksum valid.
        "declared_2tib_shape": raw_frame(codec, (layers, heads, tokens, TWO_TIB // (4 * lead * tokens)), [b""]),
        # 2**40 tokens of chunks of 1 token: parsers that enumerate the chunk table build 2**40 entries.
        "chunk_table_bomb": raw_frame(codec, (1, 1, 1 << 40, 1), [], chunk_tokens=1, num_chunks=0),
        "json_nesting": raw_frame(codec, shape, [b""], params_json=b"[" * 2000 + b"]" * 2000),
        "json_too_long": raw_frame(codec, shape, [b""], params_json=b"[" * 100_000 + b"]" * 100_000),
        "zstd_bomb_declared": raw_frame(codec, shape, [bomb_payload(declare=True)]),
        "zstd_bomb_undeclared": raw_frame(codec, shape, [bomb_payload(declare=False)]),
        "truncated_frame": genuine[: len(genuine) // 2],
    }


def hostile_chunks(keys: torch.Tensor, values: torch.Tensor) -> dict[str, bytes]:
    """Stored values (chunk bytes, unsealed) for the genuine chunk `keys`, `values` `[L, H_kv, t, D]` fp32."""
    exact = RESOLUTIONS["exact"]
    value_frame = exact.value_codec().encode(values)
    chunks = {name: _chunk(frame, value_frame) for name, frame in hostile_frames(tuple(keys.shape)).items()}
    with_nan, with_inf = keys.clone(), values.clone()
    with_nan[1, 0, 3, 2] = float("nan")
    with_inf[0, 1, 5, 0] = float("inf")
    chunks.update({
        "foreign_kv_heads": encode_chunk(exact, keys[:, :1], values[:, :1]),
        "foreign_head_dim": encode_chunk(exact, keys[..., :1], values[..., :1]),
        "fewer_layers": encode_chunk(exact, keys[:-1], values[:-1]),
        "other_dtype": encode_chunk(exact, keys.half(), values.half()),
        "nan_values": encode_chunk(exact, with_nan, values),
        "inf_values": encode_chunk(exact, keys, with_inf),
    })
    genuine = encode_chunk(exact, keys, values)
    chunks["truncated_value"] = genuine[: len(genuine) - 100]
    return chunks


def zstd_bomb(size: int, declare: bool) -> bytes:
    """A zstd frame of zeros that inflates to `size` bytes, built without holding them in memory."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declare)
    return b"".join(_stream(compressor, size, declare))


def _stream(compressor: zstandard.ZstdCompressor, size: int, declare: bool) -> Iterator[bytes]:
    piece = bytes(1 << 20)
    chunker = compressor.chunker(size=size if declare else -1, chunk_size=1 << 16)
    for _ in range(size // len(piece)):
        yield from chunker.compress(piece)
    yield from chunker.finish()


def _chunk(key_frame: bytes, value_frame: bytes) -> bytes:
    return struct.pack("<4sQ", b"KVPC", len(key_frame)) + key_frame + value_frame


def _json(params: dict[str, object]) -> bytes:
    return json.dumps(params, sort_keys=True, separators=(",", ":")).encode()
