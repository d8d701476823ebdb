"""The quantization math: codes in range, every element within scale / 2, the right grouping axis."""

from __future__ import annotations

import pytest
import torch

from kvlab.quant.groupwise import dequantize, error_bound, kv_axis, quantize
from kvlab.quant.packing import pack_codes, unpack_codes
from tests.unit.codec.matrix import random_kv


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("kind", ["keys", "values"])
@pytest.mark.parametrize("meta_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_every_element_is_within_half_a_scale(bits: int, kind: str, meta_dtype: torch.dtype) -> None:
    tensor = random_kv((3, 70, 20), torch.float32) * 3
    quantized = quantize(tensor, bits, kv_axis(kind), group_size=16, meta_dtype=meta_dtype)
    assert quantized.codes.dtype == torch.uint8 and int(quantized.codes.max()) < 2**bits
    error = (dequantize(quantized) - tensor).abs()
    # scale / 2 exactly, plus float32 rounding of the arithmetic itself.
    slack = 1e-6 * tensor.abs().max()
    excess = error - error_bound(quantized) - slack
    assert (excess <= 0).all(), f"element {tuple(int(i) for i in excess.argmax().unravel_index(excess.shape))} " \
                                f"exceeds its bound by {float(excess.max())}"


def test_keys_group_along_tokens_so_an_outlier_channel_keeps_its_own_range() -> None:
    keys = torch.randn(1, 32, 8)
    keys[..., 5] *= 1000
    quantized = quantize(keys, 4, kv_axis("keys"), group_size=32)
    assert quantized.scales.shape == (1, 1, 8)
    assert float(quantized.scales[0, 0, 0]) < float(quantized.scales[0, 0, 5]) / 100


def test_values_group_along_channels_so_each_token_has_its_own_range() -> None:
    values = torch.randn(1, 8, 32)
    values[:, 2] *= 1000
    quantized = quantize(values, 4, kv_axis("values"), group_size=32)
    assert quantized.scales.shape == (1, 8, 1)
    assert float(quantized.scales[0, 0, 0]) < float(quantized.scales[0, 2, 0]) / 100


def test_a_short_last_group_and_constant_groups_are_exact_where_they_can_be() -> None:
    tensor = torch.full((2, 10, 3), 1.5)
    quantized = quantize(tensor, 2, axis=1, group_size=4)
    assert quantized.zeros.shape == (2, 3, 3)
    assert torch.equal(dequantize(quantized), tensor)


def test_empty_tensors_quantize_to_empty_codes() -> None:
    quantized = quantize(torch.zeros(2, 0, 4), 8, axis=1, group_size=4)
    assert quantized.codes.shape == (2, 0, 4) and dequantize(quantized).shape == (2, 0, 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_are_rejected(bad: float) -> None:
    tensor = torch.zeros(2, 4)
    tensor[1, 1] = bad
    with pytest.raises(ValueError, match="finite"):
        quantize(tensor, 8, axis=0, group_size=2)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("count", [0, 1, 5, 64, 1001])
def test_packed_codes_unpack_to_the_same_codes(bits: int, count: int) -> None:
    codes = torch.randint(0, 2**bits, (count,), dtype=torch.uint8).numpy()
    packed = pack_codes(codes, bits)
    assert packed.size == -(-count * bits // 8)
    assert (unpack_codes(packed, bits, count) == codes).all()
