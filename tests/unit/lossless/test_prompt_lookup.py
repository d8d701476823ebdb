"""Prompt-lookup drafts composed with compressed-cache drafts (`ngram+NAME`): the lookup itself, greedy
output equal to plain decoding for every compressor, sampling that keeps the full model's distribution."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvlab.compress import create_compressor
from kvlab.engine import Engine, Request, generate_lossless
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig, reference_generate
from kvlab.lossless import LosslessConfig
from kvlab.lossless.prompt_lookup import LookupMatch, PromptLookup, find_match, split_drafter_name
from tests.helpers import tiny_llama
from tests.unit.lossless.scripted import ScriptedCosts
from tests.unit.lossless.test_lossless import DRAFTERS, _prompts, chi_square, second_token_marginal

LOOKUP = PromptLookup()


def test_the_longest_recent_ngram_match_gives_the_continuation() -> None:
    context = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 4, 1, 2, 3]
    # The last three tokens (1 2 3) occurred at the start: what followed them is proposed.
    assert find_match(context, 3, LOOKUP).token_ids == [9, 9, 5]
    # Without a 3-gram match, the most recent 2-gram (2 3) wins over older ones.
    assert find_match([2, 3, 7, 8, 6, 2, 3, 5, 0, 2, 3], 2, LOOKUP).token_ids == [5, 0]
    assert find_match([4, 5, 6], 4, LOOKUP).token_ids == []  # 6 never occurred before
    assert find_match([4, 6, 5, 6], 4, LOOKUP).token_ids == [5, 6]  # the match runs up to the end
    assert find_match([4, 6, 5, 6], 0, LOOKUP).token_ids == []
    # The match says how long an n-gram it found.
    assert find_match(context, 3, LOOKUP) == LookupMatch([9, 9, 5], 3)
    assert find_match([2, 3, 7, 8, 6, 2, 3, 5, 0, 2, 3], 2, LOOKUP) == LookupMatch([5, 0], 2)
    assert find_match([4, 5, 6], 4, LOOKUP) == LookupMatch([], 0)


def scanned_match(context: list[int], num_tokens: int, lookup: PromptLookup) -> LookupMatch:
    """The lookup as its definition reads: every n from the largest down, every earlier window of n tokens."""
    for size in range(min(lookup.max_ngram, len(context) - 1), lookup.min_ngram - 1, -1):
        starts = [s for s in range(len(context) - size) if context[s : s + size] == context[-size:]]
        if starts and num_tokens >= 1:
            return LookupMatch(context[starts[-1] + size : starts[-1] + size + num_tokens], size)
    return LookupMatch([], 0)


@pytest.mark.parametrize("vocab", [2, 3, 5, 50])
def test_the_lookup_equals_scanning_every_window_of_every_length(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    for lookup in (LOOKUP, PromptLookup(max_ngram=3), PromptLookup(min_ngram=2, max_ngram=4)):
        for length in (1, 2, 3, 9, 40, 200):
            for _ in range(20):
                context = torch.randint(0, vocab, (length,), generator=generator).tolist()
                for num_tokens in (0, 1, 4):
                    assert find_match(context, num_tokens, lookup) == scanned_match(context, num_tokens, lookup), \
                        (context, num_tokens, lookup)


def test_a_match_long_enough_to_be_copying_starts_from_a_higher_prior() -> None:
    short, copying = (LookupMatch([5], n).kind for n in (2, PromptLookup.copying_ngram))
    assert LOOKUP.prior_of(short) == PromptLookup.prior_acceptance < LOOKUP.prior_of(copying)
    assert LOOKUP.prior_of(copying) == PromptLookup.prior_of_match(8) == PromptLookup.copying_prior


def test_an_offer_is_of_the_kind_of_its_match_so_copying_is_judged_apart() -> None:
    """The offer names the length of its match (up to 8 tokens by default): a context copying an earlier run
    matches 8, a stray token 1, and the planner keeps an acceptance record for each."""
    phrase = list(range(10, 30))
    copying = Host(phrase + [5, 6] + phrase[:12])
    offer = LOOKUP.offer(copying, NoDraftLogits(), 4)  # type: ignore[arg-type]
    assert offer is not None and offer.token_ids == phrase[12:16]
    assert (offer.kind, offer.acceptance_key) == ("8-gram", "prompt_lookup/8-gram")
    stray = LOOKUP.offer(Host(phrase + [5, 6] + [40, 12]), NoDraftLogits(), 4)  # type: ignore[arg-type]
    assert stray is not None and stray.token_ids == phrase[3:7]
    assert (stray.kind, stray.acceptance_key) == ("1-gram", "prompt_lookup/1-gram")


@dataclasses.dataclass
class Host:
    context: list[int]

    def context_ids(self) -> list[int]:
        return self.context


class NoDraftLogits:
    in_transit = False
    draft_logits = None


def test_drafter_names_compose() -> None:
    assert split_drafter_name("ngram+snapkv") == (PromptLookup(), "snapkv")
    assert split_drafter_name("kivi") == (None, "kivi")
    with pytest.raises(ConfigError, match="after 'ngram\\+'"):
        split_drafter_name("ngram+")
    with pytest.raises(ConfigError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def repetitive_prompt(length: int) -> list[int]:
    """A prompt that repeats a phrase, so lookups find matches and the model continues it in part."""
    phrase = _prompts(12)[0]
    return (phrase * (length // len(phrase) + 1))[:length]


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_output_equals_plain_decoding_with_prompt_lookup(name: str) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompts = [repetitive_prompt(70), _prompts(60)[0]]
    config = GenerationConfig(max_new_tokens=40)
    expected = reference_generate(loaded, prompts, config)
    for draft_length in (4, "auto"):
        spec = LosslessConfig(create_compressor(name, **DRAFTERS[name]), draft_length,  # type: ignore[arg-type]
                              prompt_lookup=LOOKUP)
        engine = Engine(loaded)
        # Costs that ignore this machine's speed: a loaded machine's timings may make every round plain.
        engine.planner.costs = ScriptedCosts()
        ids = [engine.add_request(Request(prompt, config, lossless=spec)) for prompt in prompts]
        while engine.has_work():
            engine.step()
        for index, request_id in enumerate(ids):
            assert engine.output(request_id).token_ids == expected.requests[index].token_ids, \
                f"ngram+{name} k={draft_length} {index}"
        lookups = sum(stats.num_lookup_rounds for request_id in ids if (stats := engine.round_stats(request_id)))
        assert lookups > 0, "no round drafted from the lookup"


def test_lookup_rounds_are_taken_while_they_pay_and_counted() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompt = repetitive_prompt(80)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    spec = LosslessConfig(create_compressor("snapkv", **DRAFTERS["snapkv"]), "auto", prompt_lookup=LOOKUP)
    engine = Engine(loaded)
    engine.planner.costs = ScriptedCosts()  # lookups pay at these costs, whatever this machine's load
    request_id = engine.add_request(Request(prompt, config, lossless=spec))
    while engine.has_work():
        engine.step()
    stats = engine.round_stats(request_id)
    assert stats is not None and stats.num_lookup_rounds > 0
    assert stats.num_lookup_accepted_tokens <= stats.num_accepted_tokens
    assert engine.output(request_id).token_ids == reference_generate(loaded, [prompt], config).requests[0].token_ids
    assert Request(prompt, config, lossless=spec).drafter_name == "ngram+snapkv"


def test_sampled_decoding_with_prompt_lookup_follows_the_full_models_distribution() -> None:
    """As the compressed-cache test in test_lossless.py: the second token's marginal under the full model,
    against 1500 seeded runs whose round drafts one token, from the lookup (a one-hot draft distribution)
    where it finds one."""
    loaded = tiny_llama(num_kv_heads=2)
    prompt = repetitive_prompt(24)
    temperature = 0.7
    marginal = second_token_marginal(loaded, prompt, temperature)
    spec = LosslessConfig(create_compressor("streamingllm", budget=6), 2, prompt_lookup=PromptLookup(min_ngram=1))
    runs, counts, looked_up, num_rejected = 1500, torch.zeros_like(marginal), 0, 0
    for seed in range(runs):
        # Three tokens: the round after the first drafts one (a round never drafts the last token).
        config = GenerationConfig(max_new_tokens=3, temperature=temperature, seed=seed, ignore_eos=True)
        output = generate_lossless(loaded, [prompt], config, spec)
        counts[output.requests[0].token_ids[1]] += 1
        looked_up += output.lossless.num_lookup_rounds
        num_rejected += output.lossless.num_lookup_rounds == 1 and output.lossless.num_accepted_tokens == 0
    # A run's round drafts from the lookup when its sampled first token occurs in the prompt; the others
    # draft from the compressed cache. The marginal must hold over all of them.
    assert looked_up > runs // 20, f"only {looked_up} runs drafted from the lookup"
    assert num_rejected > runs // 50, f"only {num_rejected} looked-up drafts were rejected"
    statistic = chi_square(counts, marginal, runs)
    assert statistic < 27.9, statistic  # 0.999 quantile of chi-square with 8 degrees of freedom
