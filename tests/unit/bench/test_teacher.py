"""Teacher-forced passes on a tiny model: what they score is what decoding sees, checked against
transformers' own forward (full cache) and an independent masked forward (StreamingLLM)."""

from __future__ import annotations

import pytest
import torch

from kvlab.bench.likelihood import kl_divergence, perplexity
from kvlab.bench.teacher import measure_likelihood
from kvlab.compress import Compressor, compressors
from kvlab.engine import TeacherForcing, continuation_pieces, generate, teacher, teacher_forced_logits
from kvlab.generation import GenerationConfig
from kvlab.models import LoadedModel
from tests.helpers import TINY_VOCAB, plain_attention, tiny_llama

# KIVI with a short residual so the continuation crosses flushes: the prompt leaves 40 tokens, and
# 16 + 8 = 24 in the residual triggers the first flush 3 tokens into the fed continuation.
PROMPT_TOKENS = 40
NEW_TOKENS = 24
SHORT_KIVI = {"name": "kivi", "bits": 2, "residual_length": 32, "group_size": 8}
# Settings per registered compressor that make it compress the tiny prompt (registry defaults otherwise).
SETTINGS: dict[str, dict[str, object]] = {
    "kivi": SHORT_KIVI,
    "turboquant": {"name": "turboquant", "bits": 3},
    "cam": {"name": "cam", "compression_ratio": 0.5, "merge_span": 8, "window_size": 8},
    "snapkv": {"name": "snapkv", "compression_ratio": 0.5, "window_size": 8},
    "snapkv_agnostic": {"name": "snapkv_agnostic", "compression_ratio": 0.5, "window_size": 8},
    "h2o": {"name": "h2o", "compression_ratio": 0.5},
    "streamingllm": {"name": "streamingllm", "compression_ratio": 0.75},
}


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny_llama(num_kv_heads=2)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(3, TINY_VOCAB, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7)).tolist()


def _compressor(name: str) -> Compressor:
    return compressors.from_dict(SETTINGS[name])


def _greedy(loaded: LoadedModel, prompt: list[int], compressor: Compressor | None) -> list[int]:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return generate(loaded, [prompt], config, compressor=compressor).requests[0].token_ids


def test_every_registered_compressor_has_settings_here() -> None:
    assert set(SETTINGS) == set(compressors.names())


def test_eviction_and_the_full_cache_feed_the_continuation_in_one_forward() -> None:
    assert continuation_pieces(None, 40, 23) == [(0, 23)]
    assert continuation_pieces(_compressor("snapkv"), 20, 23) == [(0, 23)]
    assert continuation_pieces(_compressor("snapkv"), 20, 0) == []


def test_a_quantizer_is_fed_in_pieces_that_open_where_a_flush_hides_a_visible_token() -> None:
    # Residual 32, groups of 8: appending the 40th, 48th, ... token quantizes 8 more (num_to_quantize
    # 0 -> 8 at 40 stored tokens). After 36 stored tokens, fed token 3 makes 40.
    assert continuation_pieces(compressors.from_dict(SHORT_KIVI), 36, 20) == [(0, 3), (3, 11), (11, 19), (19, 20)]


def test_a_quantizer_that_quantizes_every_token_on_arrival_is_fed_in_one_forward() -> None:
    # Residual 0: every token a query can see is quantized whether it arrived alone or in a range.
    assert continuation_pieces(_compressor("turboquant"), 40, 23) == [(0, 23)]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_compressed_pass_predicts_what_lossy_decoding_generated(
    loaded: LoadedModel, prompt: list[int], name: str
) -> None:
    tokens = _greedy(loaded, prompt, _compressor(name))
    _, compressed = teacher_forced_logits(loaded, TeacherForcing(prompt, tokens, _compressor(name)))
    predicted = compressed.argmax(-1).tolist()
    wrong = [t for t, (want, got) in enumerate(zip(tokens, predicted, strict=True)) if want != got]
    assert not wrong, f"{name}: teacher-forced argmax differs from lossy greedy decoding at positions {wrong}"


def test_the_pieces_give_what_one_token_at_a_time_gives_where_one_forward_would_not(
    loaded: LoadedModel, prompt: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = _greedy(loaded, prompt, None)
    forcing = TeacherForcing(prompt, tokens, compressors.from_dict(SHORT_KIVI))
    _, pieces = teacher_forced_logits(loaded, forcing)
    monkeypatch.setattr(teacher, "continuation_pieces", lambda _c, _n, count: [(i, i + 1) for i in range(count)])
    _, one_at_a_time = teacher_forced_logits(loaded, forcing)
    monkeypatch.setattr(teacher, "continuation_pieces", lambda _c, _n, count: [(0, count)])
    _, one_forward = teacher_forced_logits(loaded, forcing)
    assert torch.allclose(pieces, one_at_a_time, atol=1e-5), (pieces - one_at_a_time).abs().max()
    assert (one_forward - one_at_a_time).abs().max() > 1e-3, "the continuation crosses no flush: the test shows nothing"


def test_the_full_cache_scores_as_transformers_does_and_has_kl_zero(loaded: LoadedModel, prompt: list[int]) -> None:
    tokens = _greedy(loaded, prompt, None)
    full, compressed = teacher_forced_logits(loaded, TeacherForcing(prompt, tokens))
    with plain_attention(loaded), torch.inference_mode():
        reference = loaded.model(input_ids=torch.tensor([prompt + tokens]), use_cache=False).logits[0].float()
    expected = reference[len(prompt) - 1 : -1]  # row t predicts continuation token t
    figures = measure_likelihood(loaded, TeacherForcing(prompt, tokens))
    assert torch.allclose(full, expected, atol=1e-5), (full - expected).abs().max()
    assert figures.kl == 0.0 and compressed is full
    # fp32 on both sides: the perplexities agree to 1e-5 relative.
    assert figures.ppl_full == pytest.approx(perplexity(expected, tokens), rel=1e-5)
    assert figures.ppl == figures.ppl_full


def test_a_compressor_that_keeps_everything_scores_kl_exactly_zero(loaded: LoadedModel, prompt: list[int]) -> None:
    tokens = _greedy(loaded, prompt, None)
    keep_all = compressors.from_dict({"name": "snapkv", "compression_ratio": 0.0, "window_size": 8})
    full, compressed = teacher_forced_logits(loaded, TeacherForcing(prompt, tokens, keep_all))
    assert torch.equal(kl_divergence(full, compressed), torch.zeros(len(tokens)))


def _streaming_mask(num_prompt: int, num_total: int, kept: list[int]) -> torch.Tensor:
    """[1, 1, T, T] additive mask: causal; continuation queries also miss the prompt tokens not in `kept`."""
    visible = torch.ones(num_total, num_total).tril().bool()
    evicted = [p for p in range(num_prompt) if p not in kept]
    visible[num_prompt:, evicted] = False
    return torch.zeros(num_total, num_total).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]


def test_streamingllm_scores_as_a_forward_that_masks_the_evicted_prompt_tokens(
    loaded: LoadedModel, prompt: list[int]
) -> None:
    # StreamingLLM's definition (Xiao et al.): the first num_sinks tokens plus the most recent window.
    num_sinks, budget = 4, 12
    kept = list(range(num_sinks)) + list(range(PROMPT_TOKENS - (budget - num_sinks), PROMPT_TOKENS))
    tokens = _greedy(loaded, prompt, None)
    compressor = compressors.from_dict({"name": "streamingllm", "budget": budget, "num_sinks": num_sinks})
    full, compressed = teacher_forced_logits(loaded, TeacherForcing(prompt, tokens, compressor))
    ids = torch.tensor([prompt + tokens])
    mask = _streaming_mask(PROMPT_TOKENS, ids.shape[1], kept)
    with plain_attention(loaded), torch.inference_mode():
        reference = loaded.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[0].float()
    expected = reference[PROMPT_TOKENS - 1 : -1]
    assert torch.allclose(compressed, expected, atol=1e-5), (compressed - expected).abs().max()
    kl = kl_divergence(full, compressed)
    assert torch.allclose(kl, kl_divergence(full, expected), atol=1e-5)
    assert kl[1:].min() > 0, "evicting 70% of the prompt changed no distribution: the test shows nothing"
