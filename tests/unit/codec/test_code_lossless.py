"""Code-lossless codecs: the codes come back identical, the tensor within the quantization error."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvlab.codec import CodecError
from kvlab.codec.layouts import as_tokens, integer_view
from kvlab.codec.quantized import QuantizedCodec
from kvlab.errors import ConfigError
from kvlab.quant.groupwise import error_bound
from tests.unit.codec.matrix import build, matrix_params, random_kv

CODES = matrix_params("codes")
SHAPES = [(1, 1), (3, 40, 16), (2, 2, 300, 24), (2, 0, 8), (3, 5, 0)]


def quantized_codec(name: str, params: dict[str, Any], **extra: Any) -> QuantizedCodec:
    codec = build(name, params, **extra)
    assert isinstance(codec, QuantizedCodec)
    return codec


@pytest.mark.parametrize(("name", "params"), CODES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_entropy_coded_codes_decode_to_identical_codes(name: str, params: dict[str, Any], shape: tuple) -> None:
    codec = quantized_codec(name, params, chunk_tokens=128, group_size=32)
    chunks = [as_tokens(random_kv(shape, seed=seed)) for seed in range(2)]
    codes = [codec.quantize_chunk(chunk).codes.numpy() for chunk in chunks]
    blobs = codec.encode_code_chunks(codes)
    decoded = codec.decode_code_chunks(blobs, [c.shape for c in codes])
    for index, (original, restored) in enumerate(zip(codes, decoded, strict=True)):
        assert restored.dtype == original.dtype and (restored == original).all(), f"chunk {index} codes differ"


@pytest.mark.parametrize(("name", "params"), CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_decode_equals_the_reference_dequantization_bit_for_bit(
    name: str, params: dict[str, Any], dtype: torch.dtype
) -> None:
    codec = quantized_codec(name, params, chunk_tokens=100, group_size=16)
    tensor = random_kv((2, 3, 230, 24), dtype)
    decoded = codec.decode(codec.encode(tensor))
    assert decoded.shape == tensor.shape and decoded.dtype == dtype
    assert (integer_view(decoded) == integer_view(codec.reconstruct(tensor))).all()


@pytest.mark.parametrize(("name", "params"), CODES)
def test_decoded_error_is_within_half_a_scale(name: str, params: dict[str, Any]) -> None:
    codec = quantized_codec(name, params, chunk_tokens=64, group_size=32)
    tensor = random_kv((3, 150, 40), torch.float32)
    decoded = codec.decode(codec.encode(tensor))
    tokens = as_tokens(tensor)
    for start in range(0, tokens.shape[1], 64):
        chunk = tokens[:, start : start + 64]
        bound = error_bound(codec.quantize_chunk(chunk)) + 1e-6 * float(tensor.abs().max())
        error = (as_tokens(decoded)[:, start : start + 64] - chunk).abs()
        assert (error <= bound).all(), f"chunk at token {start}: error {float((error - bound).max())} over bound"


@pytest.mark.parametrize(("name", "params"), CODES)
def test_a_frame_of_keys_is_rejected_by_the_values_codec(name: str, params: dict[str, Any]) -> None:
    other_kind = "values" if params["kind"] == "keys" else "keys"
    data = build(name, params).encode(random_kv((2, 20, 8)))
    with pytest.raises(CodecError, match="parameters"):
        build(name, {**params, "kind": other_kind}).decode(data)


@pytest.mark.parametrize("name", ["quant_zstd", "cachegen"])
def test_non_finite_input_is_a_config_error(name: str) -> None:
    tensor = random_kv((2, 8, 8))
    tensor[0, 0, 0] = float("nan")
    with pytest.raises(ConfigError, match="finite"):
        build(name, {}).encode(tensor)


def test_fewer_bits_give_smaller_frames() -> None:
    tensor = random_kv((2, 256, 64))
    sizes = [len(build("quant_zstd", {"bits": bits}).encode(tensor)) for bits in (8, 4, 2)]
    assert sizes[0] > sizes[1] > sizes[2], sizes
