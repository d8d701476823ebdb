"""Bit-exact codecs return the input's bits for every float pattern, dtype and shape."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvlab.codec import decode_frame
from kvlab.codec.layouts import integer_view
from kvlab.errors import ConfigError
from tests.unit.codec.matrix import build, matrix_params, random_kv

BIT_EXACT = matrix_params("bit-exact")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(), (0,), (7,), (1, 1), (3, 0, 5), (2, 0), (5, 7), (3, 5, 7), (2, 3, 37, 9), (1, 2, 600, 64)]


def every_bit_pattern(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bits as floats: NaNs with payloads, +-inf, subnormals and -0.0 all appear."""
    generator = torch.Generator().manual_seed(seed)
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    info = torch.iinfo(int_dtype)
    bits = torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(int_dtype)
    flat = bits.reshape(-1)
    specials = [0, info.min]  # +0.0 and -0.0
    specials += [0x7F800000, -0x00800000, 0x7FC00001, 1, -0x7FFFFFFF] if dtype == torch.float32 else \
        ([0x7C00, -0x0400, 0x7E01, 1, -0x7FFF] if dtype == torch.float16 else [0x7F80, -0x0080, 0x7FC1, 1, -0x7FFF])
    flat[: min(len(specials), flat.numel())] = torch.tensor(specials[: flat.numel()], dtype=int_dtype)
    return bits.view(dtype)


def assert_same_bits(decoded: torch.Tensor, original: torch.Tensor, what: str) -> None:
    assert decoded.shape == original.shape and decoded.dtype == original.dtype, what
    same = integer_view(decoded) == integer_view(original)
    assert same.all(), f"{what}: first differing element at {tuple(int(i[0]) for i in (~same).nonzero())}"


@pytest.mark.parametrize(("name", "params"), BIT_EXACT)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_keeps_every_bit(name: str, params: dict[str, Any], dtype: torch.dtype, shape: tuple) -> None:
    codec = build(name, params, chunk_tokens=256)
    tensor = every_bit_pattern(shape, dtype)
    data = codec.encode(tensor)
    assert_same_bits(codec.decode(data), tensor, f"{name} {params} {dtype} {shape}")
    assert_same_bits(decode_frame(data), tensor, f"decode_frame of {name}")


@pytest.mark.parametrize(("name", "params"), BIT_EXACT)
def test_many_small_chunks_round_trip(name: str, params: dict[str, Any]) -> None:
    codec = build(name, params, chunk_tokens=7)
    tensor = random_kv((2, 3, 50, 16))
    assert_same_bits(codec.decode(codec.encode(tensor)), tensor, f"{name} with 7-token chunks")


@pytest.mark.parametrize(("name", "params"), BIT_EXACT)
def test_non_contiguous_input_round_trips(name: str, params: dict[str, Any]) -> None:
    tensor = random_kv((4, 40, 16), torch.bfloat16).transpose(0, 1)
    codec = build(name, params)
    assert_same_bits(codec.decode(codec.encode(tensor)), tensor.contiguous(), f"{name} transposed input")


def test_byteplane_compresses_kv_like_data_better_than_plain_zstd() -> None:
    tensor = random_kv((4, 512, 64))
    byteplane, plain = build("byteplane", {}), build("zstd", {})
    assert len(byteplane.encode(tensor)) < len(plain.encode(tensor))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.uint8], ids=str)
def test_non_float_dtypes_are_rejected(dtype: torch.dtype) -> None:
    with pytest.raises(ConfigError, match="encodes"):
        build("raw", {}).encode(torch.zeros(3, 4, dtype=dtype))
