"""Chunk-by-chunk restoration equals whole decoding, with a buffer bounded by one chunk."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from kvlab.codec import CodecError, StreamDecoder
from kvlab.codec.layouts import integer_view
from kvlab.errors import ConfigError
from tests.unit.codec.matrix import build, matrix_params, random_kv


@pytest.mark.parametrize(("name", "params"), matrix_params())
def test_streaming_decode_equals_whole_decode(name: str, params: dict[str, Any]) -> None:
    codec = build(name, params, chunk_tokens=32)
    tensor = random_kv((2, 3, 150, 16))
    data = codec.encode(tensor)
    whole = codec.decode(data)
    target = torch.empty_like(tensor)
    progress: list[tuple[int, int]] = []
    restored = StreamDecoder(io.BytesIO(data)).restore(
        target, on_chunk=lambda done, total: progress.append((done, total))
    )
    assert restored is target
    assert (integer_view(restored) == integer_view(whole)).all()
    assert progress == [(32, 150), (64, 150), (96, 150), (128, 150), (150, 150)]


def test_the_buffer_holds_one_chunk_not_the_frame() -> None:
    codec = build("raw", {}, chunk_tokens=16)
    tensor = random_kv((4, 256, 32))
    decoder = StreamDecoder(io.BytesIO(codec.encode(tensor)))
    decoder.restore()
    one_chunk = 4 * 16 * 32 * tensor.element_size()
    assert decoder.peak_buffer_bytes == 2 * one_chunk
    assert decoder.peak_buffer_bytes < tensor.numel() * tensor.element_size() / 4


def test_chunks_larger_than_the_buffer_are_refused() -> None:
    data = build("raw", {}).encode(random_kv((2, 64, 16)))
    with pytest.raises(CodecError, match="buffer"):
        StreamDecoder(io.BytesIO(data), max_chunk_bytes=100)


def test_a_stream_cut_inside_a_chunk_raises_after_restoring_earlier_chunks() -> None:
    codec = build("raw", {}, chunk_tokens=8)
    tensor = random_kv((2, 32, 4))
    data = codec.encode(tensor)
    target = torch.zeros_like(tensor)
    with pytest.raises(CodecError, match="truncated"):
        StreamDecoder(io.BytesIO(data[:-10])).restore(target)
    assert torch.equal(target[:, :8], tensor[:, :8]), "chunks before the cut are restored"


def test_bytes_after_the_last_chunk_are_rejected() -> None:
    data = build("zstd", {}).encode(random_kv((2, 10, 4)))
    with pytest.raises(CodecError, match="extended"):
        StreamDecoder(io.BytesIO(data + b"\x00")).restore()


def test_a_target_of_the_wrong_shape_is_a_config_error() -> None:
    data = build("raw", {}).encode(random_kv((2, 10, 4)))
    with pytest.raises(ConfigError, match="shape"):
        StreamDecoder(io.BytesIO(data)).restore(torch.empty(2, 10, 5, dtype=torch.float16))
