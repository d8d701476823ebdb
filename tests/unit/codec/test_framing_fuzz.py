"""Every frame of bad bytes is rejected with CodecError: flips, truncations, extensions, mix-ups."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
import torch

from kvlab.codec import CodecError, StreamDecoder, create_codec, decode_frame, read_header
from kvlab.codec.framing import PREFIX
from tests.unit.codec.matrix import build, matrix_params, random_kv

ALL = matrix_params()
NUM_FLIPS = 48


def frame_for(name: str, params: dict[str, Any]) -> tuple[Any, bytes]:
    codec = build(name, params, chunk_tokens=16)
    return codec, codec.encode(random_kv((2, 40, 16)))


def assert_rejected(codec: Any, data: bytes, what: str) -> None:
    for decode in (codec.decode, decode_frame, lambda d: StreamDecoder(io.BytesIO(d)).restore()):
        try:
            result = decode(data)
        except CodecError:
            continue
        raise AssertionError(f"{what}: {decode} returned {type(result).__name__} instead of raising CodecError")


@pytest.mark.parametrize(("name", "params"), ALL)
def test_every_single_bit_flip_is_rejected(name: str, params: dict[str, Any]) -> None:
    codec, data = frame_for(name, params)
    rng = random.Random(f"{name}{params}")
    header_end = PREFIX.size + int.from_bytes(data[6:10], "little")
    positions = [rng.randrange(header_end) for _ in range(NUM_FLIPS // 2)]
    positions += [rng.randrange(header_end, len(data)) for _ in range(NUM_FLIPS // 2)]
    for position in positions:
        bit = rng.randrange(8)
        corrupted = bytearray(data)
        corrupted[position] ^= 1 << bit
        assert_rejected(codec, bytes(corrupted), f"bit {bit} of byte {position} flipped")


@pytest.mark.parametrize(("name", "params"), ALL)
def test_every_truncation_is_rejected(name: str, params: dict[str, Any]) -> None:
    codec, data = frame_for(name, params)
    header_end = PREFIX.size + int.from_bytes(data[6:10], "little")
    cuts = {0, 1, PREFIX.size - 1, PREFIX.size, header_end - 1, header_end, len(data) - 1}
    cuts |= set(random.Random(1).sample(range(len(data)), 10))
    for cut in sorted(cuts):
        assert_rejected(codec, data[:cut], f"truncated to {cut} of {len(data)} bytes")


@pytest.mark.parametrize(("name", "params"), ALL)
def test_every_extension_is_rejected(name: str, params: dict[str, Any]) -> None:
    codec, data = frame_for(name, params)
    for suffix in (b"\x00", b"\xff" * 7, data):
        assert_rejected(codec, data + suffix, f"extended by {len(suffix)} bytes")


def test_every_header_bit_flip_is_rejected() -> None:
    codec, data = frame_for("raw", {})
    header_end = PREFIX.size + int.from_bytes(data[6:10], "little")
    for position in range(header_end):
        for bit in range(8):
            corrupted = bytearray(data)
            corrupted[position] ^= 1 << bit
            with pytest.raises(CodecError):
                codec.decode(bytes(corrupted))


def test_a_frame_of_one_codec_is_rejected_by_another() -> None:
    data = create_codec("raw").encode(random_kv((2, 8, 4)))
    with pytest.raises(CodecError, match="holds codec 'raw'"):
        create_codec("zstd").decode(data)


def test_a_frame_with_other_parameters_is_rejected() -> None:
    data = create_codec("byteplane", order="channel-major").encode(random_kv((2, 8, 4)))
    with pytest.raises(CodecError, match="parameters"):
        create_codec("byteplane").decode(data)


@pytest.mark.parametrize("data", [b"", b"KVLC", b"not a frame at all", bytes(64), b"KVLC\x02\x00" + bytes(20)])
def test_garbage_is_rejected(data: bytes) -> None:
    for decode in (create_codec("raw").decode, decode_frame):
        with pytest.raises(CodecError):
            decode(data)


def test_header_reports_what_the_frame_holds() -> None:
    tensor = random_kv((2, 3, 40, 8), torch.bfloat16)
    header = read_header(create_codec("zstd", chunk_tokens=16).encode(tensor))
    assert (header.codec, header.dtype, header.shape, header.num_chunks) == ("zstd", torch.bfloat16, (2, 3, 40, 8), 3)
    assert header.params == {"chunk_tokens": 16, "level": 3}
