"""Lossless speculative decoding: greedy output equals plain decoding, sampling keeps the distribution."""

from __future__ import annotations

import pytest
import torch

from kvlab.compress import compressors, create_compressor
from kvlab.engine import generate_lossless
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig, reference_generate
from kvlab.lossless import LosslessConfig, greedy_accept, rejection_sample
from kvlab.models import LoadedModel
from tests.helpers import tiny_llama

# A lossy setting of every registered drafter (the matrix must cover the registry).
DRAFTERS: dict[str, dict[str, object]] = {
    "snapkv": {"compression_ratio": 0.8, "window_size": 8},
    "snapkv_agnostic": {"compression_ratio": 0.8, "window_size": 8},
    "h2o": {"budget": 16},
    "streamingllm": {"budget": 12},
    "cam": {"compression_ratio": 0.7, "merge_span": 4},
    "kivi": {"bits": 2, "group_size": 8, "residual_length": 8},
    "turboquant": {"bits": 2},
}


def _prompts(*lengths: int) -> list[list[int]]:
    return [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def test_every_registered_compressor_is_a_tested_drafter() -> None:
    assert sorted(DRAFTERS) == compressors.names()


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize("draft_length", [1, 4, 16, "auto"])
def test_greedy_output_equals_plain_decoding(name: str, draft_length: int | str) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompts = _prompts(60, 90, 45)
    config = GenerationConfig(max_new_tokens=40)
    expected = reference_generate(loaded, prompts, config)
    spec = LosslessConfig(create_compressor(name, **DRAFTERS[name]), draft_length)  # type: ignore[arg-type]
    for batch in (prompts, prompts[:1]):
        output = generate_lossless(loaded, batch, config, spec)
        for index, request in enumerate(output.requests):
            assert request.token_ids == expected.requests[index].token_ids, f"{name} k={draft_length} prompt {index}"


def test_greedy_output_equals_plain_decoding_across_eos() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompts = _prompts(50, 70, 30)
    free = reference_generate(loaded, prompts, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    # Declare a token the first prompt produces mid-way to be end-of-sequence: rows stop at different rounds.
    loaded.model.generation_config.eos_token_id = free.requests[0].token_ids[9]
    config = GenerationConfig(max_new_tokens=30)
    expected = reference_generate(loaded, prompts, config)
    assert expected.requests[0].stop_reason == "eos"
    output = generate_lossless(
        loaded, prompts, config, LosslessConfig(create_compressor("snapkv", compression_ratio=0.5), 8)
    )
    assert [r.token_ids for r in output.requests] == [r.token_ids for r in expected.requests]
    assert [r.stop_reason for r in output.requests] == [r.stop_reason for r in expected.requests]


@pytest.mark.parametrize("draft_length", [1, 4, 16])
def test_an_identity_drafter_is_always_accepted(draft_length: int) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    config = GenerationConfig(max_new_tokens=1 + 5 * (draft_length + 1), ignore_eos=True)
    spec = LosslessConfig(create_compressor("snapkv", compression_ratio=0.0), draft_length)
    output = generate_lossless(loaded, _prompts(40), config, spec)
    assert output.lossless is not None
    assert output.lossless.acceptance_length == draft_length + 1
    assert output.lossless.num_accepted_tokens == output.lossless.num_draft_tokens == 5 * draft_length
    assert output.lossless.accepted_per_position == [5] * draft_length


def test_stats_count_rounds_and_tokens() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    output = generate_lossless(
        loaded, _prompts(40, 50), GenerationConfig(max_new_tokens=20, ignore_eos=True),
        LosslessConfig(create_compressor("streamingllm", budget=8), 4),
    )
    spec = output.lossless
    assert spec is not None and spec.rounds > 0
    assert spec.num_draft_tokens == sum(spec.drafted_per_position)
    assert spec.num_accepted_tokens == sum(spec.accepted_per_position)
    assert spec.acceptance_length == pytest.approx((spec.num_accepted_tokens + spec.rounds) / spec.rounds)
    assert spec.draft_s > 0 and spec.verify_s > 0
    assert all(len(r.token_ids) == 20 for r in output.requests)


def test_greedy_accept_takes_the_longest_matching_prefix_and_the_targets_next_token() -> None:
    target_logits = torch.full((3, 4, 5), -10.0)
    for row, argmaxes in enumerate([[1, 2, 3, 4], [1, 0, 3, 4], [0, 2, 3, 4]]):
        for position, token in enumerate(argmaxes):
            target_logits[row, position, token] = 10.0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    num_accepted, next_tokens = greedy_accept(drafts, target_logits)
    assert num_accepted.tolist() == [3, 1, 0]
    assert next_tokens.tolist() == [4, 0, 0]


def test_rejection_sampling_reproduces_the_target_distribution() -> None:
    # One draft token from q, then the emitted token must follow p exactly: a chi-square statistic
    # over 60k draws stays below the 0.999 quantile (16.3 for 3 degrees of freedom); sampling the
    # emitted token from q instead gives a statistic in the thousands.
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = 60_000
    generator = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q.expand(draws, 4), 1, replacement=True, generator=generator)
    target = torch.stack([p, torch.full((4,), 0.25)]).expand(draws, 2, 4)
    num_accepted, next_tokens = rejection_sample(drafts, q.expand(draws, 1, 4), target, generator)
    emitted = torch.where(num_accepted == 1, drafts[:, 0], next_tokens)
    counts = torch.bincount(emitted, minlength=4).float()
    expected = p * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 16.3, chi_square
    wrong = torch.bincount(drafts[:, 0], minlength=4).float()
    assert float(((wrong - expected) ** 2 / expected).sum()) > 1000


def test_sampled_speculative_decoding_is_seeded() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    config = GenerationConfig(max_new_tokens=25, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    spec = LosslessConfig(create_compressor("kivi", bits=2, group_size=8, residual_length=8), 4)
    first = generate_lossless(loaded, _prompts(40), config, spec).requests[0].token_ids
    again = generate_lossless(loaded, _prompts(40), config, spec).requests[0].token_ids
    assert first == again and len(first) == 25


@pytest.mark.parametrize("draft_length", [0, -3, "many"])
def test_bad_draft_lengths_are_refused(draft_length: object) -> None:
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        LosslessConfig(create_compressor("snapkv"), draft_length)  # type: ignore[arg-type]


def test_compare_modes_marks_lossless_identical_and_finds_the_lossy_divergence() -> None:
    from kvlab.engine.compare import compare_modes, first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    loaded = tiny_llama(num_kv_heads=2)
    compressor = create_compressor("streamingllm", budget=6)
    config = GenerationConfig(max_new_tokens=30, full_kv_tier="emulated:5")
    results = compare_modes(loaded, _prompts(80, 60), config, compressor, LosslessConfig(compressor, 4))
    by_mode = {result.mode: result for result in results}
    assert by_mode["full"].identical_to_full and by_mode["lossless"].identical_to_full
    assert not by_mode["lossy"].identical_to_full
    assert by_mode["lossy"].first_divergence is not None
    # Full decoding reads the whole full KV per token; lossy never; lossless once per round.
    assert by_mode["lossy"].tier_bytes_per_token == 0
    assert 0 < by_mode["lossless"].tier_bytes_per_token < by_mode["full"].tier_bytes_per_token


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4"])
def test_a_lower_precision_drafter_keeps_the_output_identical(weights: str) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompts = _prompts(50, 70)
    config = GenerationConfig(max_new_tokens=30)
    expected = reference_generate(loaded, prompts, config)
    spec = LosslessConfig(
        create_compressor("kivi", bits=4, group_size=8, residual_length=8), 6, draft_weights=weights  # type: ignore[arg-type]
    )
    output = generate_lossless(loaded, prompts, config, spec)
    assert [r.token_ids for r in output.requests] == [r.token_ids for r in expected.requests]
    assert output.lossless is not None and output.lossless.num_accepted_tokens > 0


def test_sampled_lossless_decoding_follows_the_full_models_distribution() -> None:
    """The second token is the first one a draft decides; its marginal under the full model is
    sum_t1 p(t1) p(t2 | t1), computed exactly by one batched forward. Tokens of 1500 seeded lossless
    runs (first token from the prefill, then one round that drafts one token, which rejection sampling
    keeps or replaces) must follow it: a chi-square statistic over the top tokens stays below the
    0.999 quantile."""
    loaded = tiny_llama(num_kv_heads=2)
    prompt = _prompts(20)[0]
    temperature = 0.7
    marginal = second_token_marginal(loaded, prompt, temperature)
    drafter = create_compressor("streamingllm", budget=6)  # a poor drafter: many rejections
    runs = 1500
    counts = torch.zeros_like(marginal)
    num_rejected = 0
    for seed in range(runs):
        # Three tokens: the round after the first drafts one (a round never drafts the last token).
        config = GenerationConfig(max_new_tokens=3, temperature=temperature, seed=seed, ignore_eos=True)
        output = generate_lossless(loaded, [prompt], config, LosslessConfig(drafter, 2))
        assert output.lossless.num_draft_tokens_per_round[0] == 1
        num_rejected += output.lossless.num_accepted_tokens == 0
        counts[output.requests[0].token_ids[1]] += 1
    # The tiny model's next-token distribution barely depends on the evicted context, so most drafts are
    # kept: the rejections (and residual draws) still number in the dozens.
    assert num_rejected > runs // 50, "the drafter must be poor enough that rejections are tested"
    statistic = chi_square(counts, marginal, runs)
    assert statistic < 27.9, statistic  # 0.999 quantile of chi-square with 8 degrees of freedom


def second_token_marginal(loaded: LoadedModel, prompt: list[int], temperature: float) -> torch.Tensor:
    """[V] the full model's distribution of the second generated token, sum_t1 p(t1) p(t2 | t1), exactly
    (one batched forward over every first token)."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([prompt])).logits[0, -1]
        first = torch.softmax(logits / temperature, dim=-1)
        continued = torch.tensor([prompt + [token] for token in range(first.shape[0])])
        second = torch.softmax(loaded.model(continued).logits[:, -1] / temperature, dim=-1)
    return (first[:, None] * second).sum(dim=0)


def chi_square(counts: torch.Tensor, marginal: torch.Tensor, runs: int) -> float:
    """Pearson's statistic of `runs` draws' `counts` against `marginal`, over its 8 most likely tokens and
    the rest pooled (8 degrees of freedom)."""
    top = marginal.argsort(descending=True)[:8]
    expected, observed = marginal[top] * runs, counts[top]
    rest_expected, rest_observed = runs - expected.sum(), runs - observed.sum()
    return float(((observed - expected) ** 2 / expected).sum() + (rest_observed - rest_expected) ** 2 / rest_expected)
