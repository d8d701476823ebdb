"""The lean decoder forward: which models take it, and that its logits are transformers' bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from kvlab.cache import KVCache, Segment, run_packed
from kvlab.generation.prefill import PrefillCaches, prefill
from kvlab.models import LoadedModel, model_identity, wrap_model
from kvlab.models.decoder_forward import LEAN_MODEL_TYPES, runs_lean, use_transformers_forward
from kvlab.models.draft_weights import draft_model
from kvlab.models.int4_linear import Int4Linear, int4_kernels_available
from kvlab.models.packed_linear import FusedPackedLinear, ProjectionSlice, dense_copy, pack_linear_layers
from tests.families import FAMILIES, Family, family_named, family_params
from tests.helpers import tiny_tokenizer

PROMPT = [(7 * i + 3) % 90 + 3 for i in range(45)]
OTHER_PROMPT = [(11 * i + 5) % 90 + 3 for i in range(30)]
LEAN_FAMILIES = [param for param in family_params() if param.values[0].model_type in LEAN_MODEL_TYPES]


def test_every_lean_model_type_is_a_family_of_the_matrix() -> None:
    assert {family.model_type for family in FAMILIES} >= LEAN_MODEL_TYPES


@pytest.mark.parametrize("family", family_params())
def test_the_llama_family_runs_lean_and_fused_and_every_other_family_runs_transformers_forward(family: Family) -> None:
    loaded = _packed(family)
    lean = family.model_type in LEAN_MODEL_TYPES
    assert runs_lean(loaded.model) == lean
    fused = [module for module in loaded.model.modules() if isinstance(module, FusedPackedLinear)]
    # Projections with biases (Qwen2's q, k and v) stay apart.
    biased = lean and family.build_hf().model.layers[0].self_attn.q_proj.bias is not None
    assert len(fused) == (0 if not lean else (1 if biased else 2) * family.config().num_hidden_layers)
    use_transformers_forward(loaded.model)
    assert not runs_lean(loaded.model)
    use_transformers_forward(loaded.model, False)
    assert runs_lean(loaded.model) == lean


def _forwards(loaded: LoadedModel) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """Prefill logits, then one packed forward (a decode step of one sequence and a 1 + 3 token verify
    of the other), and the first sequence's cache."""
    first, _, prompt_logits = prefill(loaded, [PROMPT], PrefillCaches(len(PROMPT) + 8))
    second, _, _ = prefill(loaded, [OTHER_PROMPT], PrefillCaches(len(OTHER_PROMPT) + 8))
    segments = [Segment(first, 1), Segment(second, 4)]
    packed = run_packed(loaded.model, segments, [[17], [5, 9, 33, 41]], [0, 1, 2, 3, 4])
    return prompt_logits, packed, first


def _packed(family: Family) -> LoadedModel:
    """The family's model with packed linear layers (and so fused projections, where it runs lean)."""
    return wrap_model(family.build_hf(), tiny_tokenizer(), name=f"tiny-{family.name}", packed_weights=True)


def _unfused_transformers(family: Family) -> LoadedModel:
    """The same weights, packed but not fused, through transformers' own forward."""
    reference = wrap_model(family.build_hf(), tiny_tokenizer(), name="reference")
    pack_linear_layers(reference.model)
    use_transformers_forward(reference.model)
    return reference


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_the_fused_lean_forward_gives_transformers_logits_bit_for_bit(family: Family) -> None:
    lean = _packed(family)
    assert runs_lean(lean.model)
    reference = _unfused_transformers(family)
    assert not any(isinstance(module, FusedPackedLinear) for module in reference.model.modules())
    got, want = _forwards(lean), _forwards(reference)
    assert torch.equal(got[0], want[0]), f"{family.name}: prefill logits differ"
    assert torch.equal(got[1], want[1]), f"{family.name}: packed decode and verify logits differ"
    for got_layer, want_layer in zip(got[2].layers, want[2].layers, strict=True):
        assert torch.equal(got_layer.keys[:, :, : len(PROMPT) + 1], want_layer.keys[:, :, : len(PROMPT) + 1])
        assert torch.equal(got_layer.values[:, :, : len(PROMPT) + 1], want_layer.values[:, :, : len(PROMPT) + 1])


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_a_fused_model_keeps_its_names_identity_and_transformers_forward(family: Family) -> None:
    fused = _packed(family)
    plain = family.build_hf()
    assert fused.model.state_dict().keys() == plain.state_dict().keys()
    for name, tensor in plain.state_dict().items():
        assert torch.equal(fused.model.state_dict()[name], tensor), name
    assert model_identity(fused.model) == model_identity(plain)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        assert torch.equal(fused.model(ids).logits.argmax(-1), plain(ids).logits.argmax(-1))
    unpacked = dense_copy(fused.model)  # what int8 and int4 draft copies start from
    assert not any(isinstance(module, (FusedPackedLinear, ProjectionSlice)) for module in unpacked.modules())
    assert unpacked.state_dict().keys() == plain.state_dict().keys()
    duplicate = copy.deepcopy(fused.model)
    attention = duplicate.model.layers[0].self_attn
    if isinstance(attention.q_proj, ProjectionSlice):
        assert attention.q_proj.fused is attention.qkv_proj, "a copy's parts must slice the copy's fused layer"
        assert attention.q_proj.owner is attention


def test_a_model_whose_layers_were_replaced_takes_transformers_forward() -> None:
    loaded = next(f for f in FAMILIES if f.model_type == "llama").build()
    layers = loaded.model.model.layers

    class WrappedLayer(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return self.inner(*args, **kwargs)

    assert runs_lean(loaded.model)
    layers[0] = WrappedLayer(layers[0])
    use_transformers_forward(loaded.model, False)  # read the layout again
    assert not runs_lean(loaded.model)


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_a_draft_copy_is_fused_and_its_parts_call_the_quantized_fused_layer(weights: str) -> None:
    if weights == "int4" and not int4_kernels_available("cpu"):
        pytest.skip("this torch has no CPU int4 kernels")
    loaded = _packed(family_named("llama-gqa"))
    drafter = draft_model(loaded.model, weights)  # type: ignore[arg-type]
    assert runs_lean(drafter)
    expected = {"bf16": FusedPackedLinear, "int4": Int4Linear}[weights]
    for layer in drafter.model.layers:
        for fused_name, part_name in (("qkv_proj", "q_proj"), ("gate_up_proj", "up_proj")):
            owner = layer.self_attn if fused_name == "qkv_proj" else layer.mlp
            fused, part = getattr(owner, fused_name), getattr(owner, part_name)
            assert isinstance(part, ProjectionSlice) and part.fused is fused
            assert type(fused) is expected
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():  # transformers' forward through the parts, against the exact model
        drafted, exact = drafter(ids).logits, loaded.model(ids).logits
    error = (drafted - exact).abs().max() / exact.abs().max()
    assert 0 < error < 0.5, f"{weights} logits are off by {error:.2e} of the largest: not a copy of this model"


def test_an_int8_draft_copy_keeps_its_projections_apart() -> None:
    # One dynamic-quantization scale per weight: over fused q, k and v it would coarsen k and v's codes.
    drafter = draft_model(_packed(family_named("llama-gqa")).model, "int8")
    attention = drafter.model.layers[0].self_attn
    assert not hasattr(attention, "qkv_proj") and not hasattr(drafter.model.layers[0].mlp, "gate_up_proj")
    assert "Linear" in type(attention.q_proj).__name__ and not isinstance(attention.q_proj, ProjectionSlice)
