"""The lean forward compiled as one graph: the eager forward's logits (within float32 reordering), every
count of tokens and rows from one graph, each model its own weights, kvlab's equality claims kept."""

from __future__ import annotations

import pytest
import torch

from kvlab.cache import KVCache, Segment, run_packed
from kvlab.compress import create_compressor
from kvlab.engine import generate_lossless
from kvlab.generation import GenerationConfig, reference_generate
from kvlab.generation.prefill import PrefillCaches, prefill
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel
from kvlab.models.compiled_forward import compilable, compile_forward, is_compiled, uncompile_forward
from kvlab.models.decoder_forward import COMPILED_FORWARD_ATTRIBUTE, fuse_projections
from kvlab.models.draft_weights import draft_model
from tests.families import family_named
from tests.helpers import tiny_llama

PROMPT = [(7 * i + 3) % 90 + 3 for i in range(45)]
OTHER_PROMPT = [(11 * i + 5) % 90 + 3 for i in range(30)]
# Inductor sums the norms in another order than eager torch: the tiny model's float32 logits moved by
# 1.1e-7 at most (measured); the tolerance is relative to the largest logit.
TOLERANCE = 1e-5


def _dense(seed: int = 0) -> LoadedModel:
    loaded = tiny_llama(num_kv_heads=2, seed=seed, packed_weights=False)
    fuse_projections(loaded.model)
    return loaded


@pytest.fixture(scope="module")
def models() -> tuple[LoadedModel, LoadedModel]:
    """(eager, compiled): the same weights, the second compiled (once for the module's tests)."""
    eager, compiled = _dense(), _dense()
    assert compile_forward(compiled.model)
    return eager, compiled


def _forwards(loaded: LoadedModel) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    """Prefill logits of one prompt, then one packed forward of two sequences (a decode step of the
    first and a 1 + 3 token verify of the second), and the first sequence's cache."""
    first, _, prompt_logits = prefill(loaded, [PROMPT], PrefillCaches(len(PROMPT) + 8))
    second, _, _ = prefill(loaded, [OTHER_PROMPT], PrefillCaches(len(OTHER_PROMPT) + 8))
    packed = run_packed(loaded.model, [Segment(first, 1), Segment(second, 4)], [[17], [5, 9, 33, 41]], [0, 1, 2, 3, 4])
    return prompt_logits, packed, first


def test_compiled_logits_are_the_eager_forwards_for_prefill_decode_and_verify(
    models: tuple[LoadedModel, LoadedModel],
) -> None:
    eager, compiled = models
    want, got = _forwards(eager), _forwards(compiled)
    for name, expected, actual in (("prefill", want[0], got[0]), ("packed step", want[1], got[1])):
        assert actual.shape == expected.shape, name
        assert torch.allclose(actual, expected, rtol=0, atol=TOLERANCE * expected.abs().max().item()), name
        assert torch.equal(actual.argmax(-1), expected.argmax(-1)), name
    for want_layer, got_layer in zip(want[2].layers, got[2].layers, strict=True):
        stored = slice(0, len(PROMPT) + 1)
        assert torch.allclose(got_layer.keys[:, :, stored], want_layer.keys[:, :, stored], atol=1e-5)


def test_one_graph_serves_every_token_count_and_packed_batch(models: tuple[LoadedModel, LoadedModel]) -> None:
    _, compiled = models
    _forwards(compiled)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    caches = [prefill(compiled, [PROMPT[: 12 + i]], PrefillCaches(60))[0] for i in range(3)]
    for num_tokens in (1, 2, 7):
        run_packed(compiled.model, [Segment(caches[0], num_tokens)], [PROMPT[:num_tokens]], [num_tokens - 1])
    # Three sequences packed in one forward: 1 + 4 + 2 tokens, logits at two of them.
    segments = [Segment(caches[0], 1), Segment(caches[1], 4), Segment(caches[2], 2)]
    run_packed(compiled.model, segments, [[5], [6, 7, 8, 9], [10, 11]], [0, 6])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before


def test_each_model_runs_its_own_weights() -> None:
    first, second = _dense(seed=1), _dense(seed=2)
    want = [_forwards(first)[1], _forwards(second)[1]]
    assert compile_forward(first.model) and compile_forward(second.model)
    got = [_forwards(first)[1], _forwards(second)[1]]
    assert not torch.allclose(want[0], want[1])
    for expected, actual in zip(want, got, strict=True):
        assert torch.allclose(actual, expected, rtol=0, atol=TOLERANCE * expected.abs().max().item())


def test_captured_keys_outlive_the_graphs_buffers(models: tuple[LoadedModel, LoadedModel]) -> None:
    """A step that keeps each layer's new keys and values (a draft cache, a prefix store) keeps them
    unchanged after later forwards, whose buffers the graph reuses."""
    _, compiled = models
    cache, _, _ = prefill(compiled, [PROMPT], PrefillCaches(len(PROMPT) + 8))
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    run_packed(compiled.model, [Segment(cache, 2, captured=captured)], [[17, 23]], [1])
    kept = [(keys.clone(), values.clone()) for keys, values in captured]
    for _ in range(3):
        run_packed(compiled.model, [Segment(cache, 2)], [[40, 41]], [1])
    assert len(captured) == compiled.model.config.num_hidden_layers
    for (keys, values), (keys_then, values_then) in zip(captured, kept, strict=True):
        assert torch.equal(keys, keys_then) and torch.equal(values, values_then)
    stored = cache.layers[0].keys[:, :, len(PROMPT) : len(PROMPT) + 2]
    assert torch.equal(stored, kept[0][0])


@pytest.mark.parametrize("draft_length", [3, "auto"])
def test_lossless_decoding_with_a_compiled_model_equals_its_plain_decoding(
    models: tuple[LoadedModel, LoadedModel], draft_length: int | str
) -> None:
    _, compiled = models
    prompts = [PROMPT, OTHER_PROMPT]
    config = GenerationConfig(max_new_tokens=24)
    expected = reference_generate(compiled, prompts, config)
    spec = LosslessConfig(create_compressor("snapkv", compression_ratio=0.7, window_size=8), draft_length)  # type: ignore[arg-type]
    output = generate_lossless(compiled, prompts, config, spec)
    assert [r.token_ids for r in output.requests] == [r.token_ids for r in expected.requests]


def test_what_the_graph_cannot_take_keeps_the_eager_forward(models: tuple[LoadedModel, LoadedModel]) -> None:
    _, compiled = models
    packed = tiny_llama(num_kv_heads=2)  # oneDNN-packed layers hold opaque tensors
    assert not compilable(packed.model) and not compile_forward(packed.model) and not is_compiled(packed.model)
    gemma = family_named("gemma2").build_hf()  # not a family the lean forward runs
    assert not compile_forward(gemma)
    # A draft copy holds its own weights: a graph of its own (bf16), or the eager forward (int8 layers).
    bf16 = draft_model(compiled.model, "bf16")  # type: ignore[arg-type]
    assert is_compiled(bf16)
    assert getattr(bf16, COMPILED_FORWARD_ATTRIBUTE) is not getattr(compiled.model, COMPILED_FORWARD_ATTRIBUTE)
    assert not is_compiled(draft_model(compiled.model, "int8"))  # type: ignore[arg-type]
    eager = _dense()
    compile_forward(eager.model)
    uncompile_forward(eager.model)
    assert not is_compiled(eager.model)
