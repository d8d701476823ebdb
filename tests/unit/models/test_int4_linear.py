"""Int4 linear layers: the quantizer's round trip within half a step, the CPU kernel held to the plain-torch
reference (relative 1e-5 in float32), shapes the kernel cannot take refused or left in float, and int4 draft
copies that replace every linear layer of a model and leave the model itself untouched. That lossless
decoding with int4 drafts equals plain decoding is tested with the other draft weights in
tests/unit/lossless/test_lossless.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlab.errors import ConfigError
from kvlab.models import draft_weights
from kvlab.models.decoder_forward import fuse_projections
from kvlab.models.draft_weights import DRAFT_WEIGHTS, draft_model
from kvlab.models.int4_linear import (
    Int4Linear,
    choose_group_size,
    dequantize_int4,
    int4_kernels_available,
    int4_linear_reference,
    quantize_int4,
    quantize_linear_layers,
)
from kvlab.models.packed_linear import PackedLinear, dense_copy
from kvlab.serve.config import DRAFT_WEIGHTS_NAMES
from tests.helpers import TINY_VOCAB, tiny_llama

requires_int4 = pytest.mark.skipif(not int4_kernels_available("cpu"), reason="this torch has no CPU int4 kernels")
# The kernel computes in bfloat16 (its fast path: inputs, scales and mids rounded to 8-bit mantissas) and
# dequantizes as (code - 8) * scale + mid; the reference in float32 as code * scale + zero. Measured within
# 3.4e-3 of the largest output on these shapes; a tolerance, not an equality: drafts only need closeness.
RELATIVE_TOLERANCE = 2**-6
PROMPT = [1, 5, 7, 9, 11, 13, 17]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


@pytest.mark.parametrize(("shape", "group_size"), [((16, 64), 64), ((48, 96), 32), ((7, 256), 128), ((3, 64), 16)])
def test_every_weight_is_within_half_a_step_of_its_dequantized_value(shape: tuple[int, int], group_size: int) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    codes, scales, zeros, _ = quantize_int4(weight, group_size)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    restored = dequantize_int4(codes, scales, zeros, group_size)
    step = scales.repeat_interleave(group_size, dim=1)
    # Half a step, plus float32 rounding of the division and of code * scale + zero.
    bound = step / 2 + 4 * torch.finfo(torch.float32).eps * weight.abs()
    excess = (weight - restored).abs() - bound
    row, column = divmod(int(excess.argmax()), shape[1])
    assert float(excess.max()) <= 0, f"weight [{row}, {column}] is {float(excess.max()):.2e} past half a step"


def test_a_constant_group_dequantizes_exactly() -> None:
    weight = torch.cat([torch.full((4, 32), 0.3), torch.randn(4, 32)], dim=1)
    codes, scales, zeros, _ = quantize_int4(weight, 32)
    assert torch.equal(dequantize_int4(codes, scales, zeros, 32)[:, :32], weight[:, :32])
    assert bool((scales > 0).all()), "a constant group must still get a non-zero scale (the kernel divides by none)"


def test_the_quantizer_refuses_a_group_size_that_does_not_divide_the_row() -> None:
    with pytest.raises(ConfigError, match="group size 64 must divide in_features 96"):
        quantize_int4(torch.randn(16, 96), 64)


@requires_int4
@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size", "lead", "bias"),
    [
        (16, 32, 32, (1,), False),
        (48, 96, None, (2, 3), True),
        (64, 128, 64, (1, 5), True),
        (96, 256, 128, (7,), False),
        (32, 512, 256, (2, 1, 3), True),
        (1536, 576, None, (1, 9), False),
    ],
)
def test_the_kernel_equals_the_reference(out_features: int, in_features: int, group_size: int | None,
                                         lead: tuple[int, ...], bias: bool) -> None:
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    biases = torch.randn(out_features, generator=generator) if bias else None
    inputs = torch.randn(*lead, in_features, generator=generator)
    layer = Int4Linear(weight, biases, group_size)
    codes, scales, zeros, size = quantize_int4(weight, layer.group_size)
    with torch.inference_mode():
        actual = layer(inputs)
    expected = int4_linear_reference(inputs, codes, scales, zeros, size, biases)
    assert actual.shape == (*lead, out_features) and actual.dtype == torch.float32
    error = relative_error(actual, expected)
    assert error < RELATIVE_TOLERANCE, f"[{out_features}, {in_features}] g{size}: off by {error:.2e} of the largest"


@requires_int4
def test_the_output_keeps_the_dtype_of_its_input() -> None:
    weight, inputs = torch.randn(32, 64), torch.randn(2, 3, 64)
    layer = Int4Linear(weight.bfloat16(), torch.randn(32).bfloat16())
    with torch.inference_mode():
        actual = layer(inputs.bfloat16())
    assert actual.dtype == torch.bfloat16
    codes, scales, zeros, size = quantize_int4(weight.bfloat16(), layer.group_size)
    expected = int4_linear_reference(inputs.bfloat16(), codes, scales, zeros, size, layer.bias)
    # Both compute in float32 and round once to bfloat16: at most one step of its 8-bit mantissa apart.
    assert relative_error(actual, expected) < 2**-7


@requires_int4
def test_an_empty_batch_gives_an_empty_output() -> None:
    with torch.inference_mode():
        assert Int4Linear(torch.randn(16, 64), None)(torch.randn(0, 64)).shape == (0, 16)


def test_the_group_size_is_64_where_it_divides_the_row_else_32() -> None:
    assert [choose_group_size(k) for k in (64, 576, 96, 1536, 48)] == [64, 64, 32, 64, 64]


@pytest.mark.parametrize(
    ("shape", "group_size", "message"),
    [
        ((24, 64), None, "out_features must be a multiple of 16, got 24"),
        ((32, 48), None, r"the group size \(64\) must divide in_features, got 48"),
        ((32, 64), 16, "the group size must be one of 32, 64, 128, 256, got 16"),
    ],
)
def test_a_shape_the_kernel_cannot_take_is_refused_with_what_it_needs(
    shape: tuple[int, int], group_size: int | None, message: str
) -> None:
    expected = f"cannot pack a \\[{shape[0]}, {shape[1]}\\] linear weight into int4: .*{message}"
    with pytest.raises(ConfigError, match=expected):
        Int4Linear(torch.randn(shape), None, group_size)


@requires_int4
def test_layers_the_kernel_cannot_take_stay_in_float() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 24))
    head = model[2]
    assert quantize_linear_layers(model) == ["2"]
    assert isinstance(model[0], Int4Linear) and model[2] is head
    with torch.inference_mode():
        assert model(torch.randn(3, 64)).shape == (3, 24)


@requires_int4
def test_the_weight_bytes_are_the_packed_codes_and_the_scales_and_zeros() -> None:
    layer = Int4Linear(torch.randn(64, 128), torch.randn(64), group_size=64)
    # 4 bits per weight, then a bfloat16 scale and a bfloat16 mid per row and group of 64.
    assert layer.weight_nbytes() == 64 * 128 // 2 + 64 * (128 // 64) * 2 * 2


@requires_int4
def test_an_int4_draft_copy_replaces_every_linear_and_leaves_the_model_untouched() -> None:
    loaded = tiny_llama()
    before = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}
    # One int4 layer per linear layer of the float copy, whose q/k/v and gate/up projections are fused.
    duplicate = dense_copy(loaded.model)
    fuse_projections(duplicate)
    num_linears = sum(type(module) is torch.nn.Linear for module in duplicate.modules())
    num_packed = sum(isinstance(module, PackedLinear) for module in loaded.model.modules())
    drafter = draft_model(loaded.model, "int4")
    assert draft_model(loaded.model, "int4") is drafter, "the copy is made once per model"
    assert sum(isinstance(module, Int4Linear) for module in drafter.modules()) == num_linears > 0
    assert not any(isinstance(module, (torch.nn.Linear, PackedLinear)) for module in drafter.modules())
    assert sum(isinstance(module, PackedLinear) for module in loaded.model.modules()) == num_packed
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed"
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        exact, drafted = loaded.model(ids).logits, drafter(ids).logits
    error = relative_error(drafted, exact)
    assert 1e-4 < error < 0.5, f"int4 logits are off by {error:.2e} of the largest: not a 4-bit copy of this model"


@requires_int4
def test_a_tied_lm_head_is_quantized_and_the_embedding_keeps_its_float_weight() -> None:
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    embedding = model.model.embed_tokens.weight.detach().clone()
    drafter = draft_model(model, "int4")
    assert isinstance(drafter.lm_head, Int4Linear)
    assert torch.equal(drafter.model.embed_tokens.weight, embedding)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the original must stay tied"


def test_int4_draft_weights_are_refused_where_the_kernel_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(draft_weights, "int4_kernels_available", lambda device: False)
    with pytest.raises(ConfigError, match="int4 draft weights use PyTorch's CPU int4 kernels.*use draft weights"):
        draft_model(tiny_llama(packed_weights=False).model, "int4")


def test_int4_draft_weights_are_refused_off_the_cpu() -> None:
    model = tiny_llama(packed_weights=False).model.to("meta")
    with pytest.raises(ConfigError, match=r"CPU int4 kernels, which this model \(meta\)"):
        draft_model(model, "int4")


@requires_int4
def test_a_model_without_a_linear_layer_the_kernel_takes_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 24))
    with pytest.raises(ConfigError, match="no linear layer of this model .* use draft weights 'int8'"):
        draft_model(model, "int4")  # type: ignore[arg-type]


def test_the_server_accepts_every_draft_weight_name() -> None:
    # kvlab.serve.config spells the names out so that `kvlab serve --help` loads no torch: they must agree.
    assert DRAFT_WEIGHTS_NAMES == DRAFT_WEIGHTS
