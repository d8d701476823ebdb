"""Only malformed bytes become `CodecError`, with the decoder's error kept as its cause; a kvlab bug, an
exhausted memory or an interrupt inside a decoder goes on up as itself (never reported as corrupt data)."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
import zstandard

from kvlab.codec import CodecError, StreamDecoder, codecs, create_codec, decode_frame, framing
from kvlab.codec import quantized as quantized_module
from kvlab.codec import zstd as zstd_module
from kvlab.codec.framing import pack_sections, unpack_sections
from kvlab.errors import ConfigError
from tests.unit.codec.matrix import random_kv

SHAPE = (2, 40, 16)
# What kvlab's own code raises when it is wrong, and what the machine raises: never "corrupt data".
NOT_MALFORMED = [TypeError("bug"), AttributeError("bug"), AssertionError("bug"), MemoryError(), KeyboardInterrupt(),
                 ConfigError("the video codecs need PyAV: pip install 'av>=12'")]
# What decoders raise on malformed bytes.
MALFORMED = [ValueError("cannot reshape"), IndexError("index out of range"), EOFError("short read"),
             struct.error("unpack requires a buffer of 8 bytes"), OverflowError("too large"),
             zstandard.ZstdError("corrupted block")]


def raising(error: BaseException) -> Callable[..., Any]:
    def raise_it(*args: Any, **kwargs: Any) -> Any:
        raise error

    return raise_it


def reframed(codec: Any, data: bytes, change: Callable[[bytes], bytes]) -> bytes:
    """`data` with each chunk payload changed and its checksums recomputed, so only the decoder can object."""
    header, payloads = framing.read_frame(data)
    return framing.write_frame(codec.name, codec.layout(), codec.params(), header.dtype, header.shape,
                               header.chunk_tokens, [change(bytes(payload)) for payload in payloads])


DECODERS: dict[str, Callable[[Any, bytes], torch.Tensor]] = {
    "decode": lambda codec, data: codec.decode(data),
    "decode_frame": lambda codec, data: decode_frame(data),
    "stream": lambda codec, data: StreamDecoder(io.BytesIO(data)).restore(),
    "stream_by_token": lambda codec, data: StreamDecoder(io.BytesIO(data)).restore(by_token=True),
}


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("error", NOT_MALFORMED, ids=lambda error: type(error).__name__)
def test_an_error_that_is_not_about_the_bytes_goes_on_up_as_itself(
    decoder: str, error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = create_codec("zstd", chunk_tokens=16)
    data = codec.encode(random_kv(SHAPE))
    monkeypatch.setattr(zstd_module, "zstd_decompress", raising(error))
    with pytest.raises(type(error)) as raised:
        DECODERS[decoder](codec, data)
    assert raised.value is error, f"{decoder}: {type(error).__name__} came back as {raised.value!r}"


@pytest.mark.parametrize("decoder", ["decode", "stream_by_token"])
@pytest.mark.parametrize("error", NOT_MALFORMED[:4], ids=lambda error: type(error).__name__)
def test_a_bug_in_a_quantized_codec_goes_on_up_as_itself_chunk_by_chunk_and_token_by_token(
    decoder: str, error: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = create_codec("quant_zstd", kind="keys", bits=4, chunk_tokens=16)
    data = codec.encode(random_kv(SHAPE))
    monkeypatch.setattr(quantized_module, "unpack_sections", raising(error))
    monkeypatch.setattr(type(codec), "decodes_by_token", True)  # restore_by_token, not decode_into
    with pytest.raises(type(error)) as raised:
        DECODERS[decoder](codec, data)
    assert raised.value is error, f"{decoder}: {type(error).__name__} came back as {raised.value!r}"


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("error", MALFORMED, ids=lambda error: type(error).__name__)
def test_what_decoders_raise_on_malformed_bytes_is_a_codec_error_caused_by_it(
    decoder: str, error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = create_codec("zstd", chunk_tokens=16)
    data = codec.encode(random_kv(SHAPE))
    monkeypatch.setattr(zstd_module, "zstd_decompress", raising(error))
    with pytest.raises(CodecError) as raised:
        DECODERS[decoder](codec, data)
    assert raised.value.__cause__ is error, f"{decoder}: the cause {error!r} was lost: {raised.value.__cause__!r}"
    assert type(error).__name__ in str(raised.value)


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_truncated_zstd_block_is_a_codec_error_caused_by_zstd(decoder: str) -> None:
    codec = create_codec("zstd", chunk_tokens=16)
    data = reframed(codec, codec.encode(random_kv(SHAPE)), lambda payload: payload[:-3])
    with pytest.raises(CodecError, match="does not decode") as raised:
        DECODERS[decoder](codec, data)
    assert isinstance(raised.value.__cause__, zstandard.ZstdError), repr(raised.value.__cause__)


def test_a_zstd_block_without_a_frame_header_keeps_the_zstd_error_as_its_cause() -> None:
    codec = create_codec("zstd", chunk_tokens=16)
    data = reframed(codec, codec.encode(random_kv(SHAPE)), lambda payload: b"\x00" * len(payload))
    with pytest.raises(CodecError, match="no valid frame header") as raised:
        codec.decode(data)
    assert isinstance(raised.value.__cause__, zstandard.ZstdError), repr(raised.value.__cause__)


@pytest.mark.parametrize("by_token", [False, True])
def test_a_corrupt_video_packet_is_a_codec_error_caused_by_ffmpeg(by_token: bool) -> None:
    av = pytest.importorskip("av")
    codec = create_codec("video_codes", kind="keys", bits=3, format="ffv1", chunk_tokens=16)

    def spoil_first_frame(payload: bytes) -> bytes:
        meta, codes = unpack_sections(payload, 2)
        sections = [bytes(section) for section in unpack_sections(codes)]
        sections[2] = b"\xff" * len(sections[2])  # pixel format, extradata, then the first frame's packet
        return pack_sections([bytes(meta), pack_sections(sections)])

    data = reframed(codec, codec.encode(random_kv((2, 16, 16))), spoil_first_frame)
    with pytest.raises(CodecError) as raised:
        StreamDecoder(io.BytesIO(data)).restore(by_token=by_token)
    assert isinstance(raised.value.__cause__, av.error.FFmpegError), repr(raised.value.__cause__)


def test_a_frame_naming_parameters_no_codec_has_is_a_codec_error_caused_by_the_registry() -> None:
    codec = create_codec("zstd", chunk_tokens=16)
    header, payloads = framing.read_frame(codec.encode(random_kv(SHAPE)))
    data = framing.write_frame("zstd", codec.layout(), {**codec.params(), "speed": 11}, header.dtype, header.shape,
                               header.chunk_tokens, [bytes(payload) for payload in payloads])
    with pytest.raises(CodecError, match="cannot build") as raised:
        StreamDecoder(io.BytesIO(data))
    assert isinstance(raised.value.__cause__, ConfigError), repr(raised.value.__cause__)


def test_a_bug_while_building_the_codec_a_frame_names_goes_on_up_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    data = create_codec("zstd", chunk_tokens=16).encode(random_kv(SHAPE))
    bug = TypeError("bug")
    monkeypatch.setattr(codecs, "create", raising(bug))
    with pytest.raises(TypeError) as raised:
        StreamDecoder(io.BytesIO(data))
    assert raised.value is bug
