"""oneDNN-packed linear layers: held to `F.linear` (argmax equal, relative 1e-5), lossless to copy,
move and save, invisible to the model's identity, and greedy output equal to transformers' layers."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from kvlab.engine import generate
from kvlab.generation import GenerationConfig
from kvlab.models import model_identity, wrap_model
from kvlab.models.draft_weights import draft_model
from kvlab.models.packed_linear import (
    PackedLinear,
    dense_copy,
    is_packed,
    pack_linear_layers,
    packing_available,
    unpack_linear_layers,
)
from tests.families import FAMILIES, Family
from tests.helpers import plain_attention, tiny_llama, tiny_tokenizer, transformers_greedy

NO_ONEDNN = (
    "this torch has no oneDNN linear packing (torch.backends.mkldnn), so kvlab's default CPU load path (packed "
    "linear layers) is untested here; install the standard PyPI torch build"
)


def require_onednn(available: bool) -> None:
    """Skip without oneDNN, except under CI (CI=true), where the default load path must be tested: fail."""
    if available:
        return
    if os.environ.get("CI", "").lower() in ("1", "true"):
        pytest.fail(NO_ONEDNN + " (CI must run these tests)")
    pytest.skip(NO_ONEDNN)


@pytest.fixture(autouse=True)
def _onednn() -> None:
    require_onednn(packing_available("cpu", torch.float32))

RELATIVE_TOLERANCE = 1e-5
"""Packed products are float32 sums in oneDNN's order: measured within 3e-6 of `F.linear`'s, relative to
the largest output."""

PROMPTS = [[1, 5, 9, 14, 3, 22, 7], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [1, 88]]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("rows", [1, 2, 9, 64, 513])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear_within_tolerance(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 160, bias=bias)
    packed = PackedLinear.from_linear(linear)
    inputs = torch.randn(2, rows, 96)
    with torch.no_grad():
        expected = linear(inputs)
        actual = packed(inputs)
        assert torch.equal(packed.reference(inputs), expected), "the reference path is F.linear itself"
    assert actual.shape == expected.shape
    assert relative_error(actual, expected) < RELATIVE_TOLERANCE
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


def test_dense_weight_round_trips_bit_for_bit() -> None:
    linear = torch.nn.Linear(64, 48)
    packed = PackedLinear.from_linear(linear)
    assert torch.equal(packed.weight, linear.weight)
    back = packed.to_linear()
    assert type(back) is torch.nn.Linear
    assert torch.equal(back.weight, linear.weight) and torch.equal(back.bias, linear.bias)


def test_deepcopy_packs_an_independent_copy() -> None:
    packed = PackedLinear.from_linear(torch.nn.Linear(32, 16))
    duplicate = copy.deepcopy(packed)
    assert duplicate.packed_weight is not packed.packed_weight
    assert torch.equal(duplicate.weight, packed.weight)
    inputs = torch.randn(3, 32)
    assert torch.equal(duplicate(inputs), packed(inputs))


def test_bfloat16_conversion_packs_bf16_weights() -> None:
    linear = torch.nn.Linear(64, 32, bias=False)
    packed = PackedLinear.from_linear(linear).bfloat16()
    assert packed.packed_weight.dtype == torch.bfloat16
    inputs = torch.randn(4, 64).bfloat16()
    expected = torch.nn.functional.linear(inputs, linear.weight.bfloat16())
    assert torch.equal(packed(inputs).argmax(-1), expected.argmax(-1))


def test_a_move_packing_cannot_follow_is_refused_with_the_way_out() -> None:
    packed = PackedLinear.from_linear(torch.nn.Linear(8, 8))
    with pytest.raises(RuntimeError, match="unpack_linear_layers"):
        packed.half()


def test_state_dict_carries_dense_weights_that_load_into_an_unpacked_model() -> None:
    loaded = tiny_llama()
    reference = tiny_llama(packed_weights=False)
    state = loaded.model.state_dict()
    assert set(state) == set(reference.model.state_dict())
    fresh = tiny_llama(seed=1, packed_weights=False)
    fresh.model.load_state_dict(state)
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name


def test_packing_is_invisible_to_the_model_identity_but_weights_are_not() -> None:
    packed, unpacked = tiny_llama(), tiny_llama(packed_weights=False)
    assert model_identity(packed.model) == model_identity(unpacked.model)
    other = tiny_llama(packed_weights=False)
    with torch.no_grad():
        other.model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    pack_linear_layers(other.model)
    assert model_identity(other.model) != model_identity(packed.model), "a packed weight must change the identity"


def test_pack_and_unpack_replace_every_linear_layer() -> None:
    loaded = tiny_llama(packed_weights=False)
    count = sum(type(module) is torch.nn.Linear for module in loaded.model.modules())
    assert pack_linear_layers(loaded.model) == count
    assert not any(type(module) is torch.nn.Linear for module in loaded.model.modules())
    assert loaded.packed_weights
    assert unpack_linear_layers(loaded.model) == count
    assert not loaded.packed_weights


def test_a_tied_lm_head_is_packed_as_a_copy_and_the_embedding_stays() -> None:
    family = next(family for family in FAMILIES if family.name == "llama-gqa")
    model = family.build_hf()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    embedding = model.get_input_embeddings().weight
    pack_linear_layers(model)
    head = model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.tied
    assert model.get_input_embeddings().weight is embedding
    assert torch.equal(head.weight, embedding)


def test_a_torch_without_onednn_fails_these_tests_under_ci_and_skips_them_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run these tests"):
        require_onednn(False)
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no oneDNN linear packing"):
        require_onednn(False)
    require_onednn(True)


def test_packing_refuses_what_it_cannot_pack() -> None:
    assert not packing_available("cuda", torch.float32)
    assert not packing_available("cpu", torch.float16)
    model = tiny_llama(packed_weights=False).model.half()
    assert pack_linear_layers(model) == 0


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_draft_weight_copies_of_a_packed_model_run(weights: str) -> None:
    loaded = tiny_llama()
    drafter = draft_model(loaded.model, weights)  # type: ignore[arg-type]
    with torch.inference_mode():
        logits = drafter(torch.tensor([PROMPTS[0]])).logits
    assert logits.shape == (1, len(PROMPTS[0]), loaded.model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_dense_copy_has_plain_linear_layers_and_equal_weights() -> None:
    loaded = tiny_llama()
    duplicate = dense_copy(loaded.model)
    assert not is_packed(duplicate)
    expected = loaded.model.state_dict()
    for name, tensor in duplicate.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("family", [family for family in FAMILIES if family.unsupported is None], ids=lambda f: f.name)
def test_packed_greedy_equals_transformers_layers_in_every_family(family: Family) -> None:
    reference = family.build_hf()
    loaded = wrap_model(family.build_hf(), tiny_tokenizer(), name=f"tiny-{family.name}", packed_weights=True)
    assert loaded.packed_weights
    config = GenerationConfig(max_new_tokens=16)
    for prompt in PROMPTS:
        expected = transformers_greedy(wrap_model(reference, tiny_tokenizer()), prompt, max_new_tokens=16)
        assert generate(loaded, [prompt], config).requests[0].token_ids == expected, f"prompt {prompt}"
    ids = torch.tensor([PROMPTS[1]])
    with plain_attention(loaded), plain_attention(reference), torch.inference_mode():
        error = relative_error(loaded.model(ids).logits, reference(ids).logits)
    assert error < RELATIVE_TOLERANCE, f"{family.name}: logits differ by {error:.2e} of their largest"
