"""Plain generation: greedy equals transformers, batches, sampling, stopping, bad input."""

from __future__ import annotations

import pytest
import torch

from kvlab.engine import generate
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig, token_probabilities
from kvlab.models import LoadedModel
from tests.helpers import tiny_llama, transformers_greedy


def _prompts(*lengths: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(3, 96, (n,), generator=generator).tolist() for n in lengths]


def test_greedy_equals_transformers_generate(tiny_model: LoadedModel) -> None:
    for prompt in _prompts(5, 23, 60):
        expected = transformers_greedy(tiny_model, prompt, max_new_tokens=40)
        output = generate(tiny_model, [prompt], GenerationConfig(max_new_tokens=40))
        assert output.requests[0].token_ids == expected


def test_a_batch_of_different_lengths_equals_each_prompt_alone(tiny_model: LoadedModel) -> None:
    prompts = _prompts(4, 31, 17)
    config = GenerationConfig(max_new_tokens=24)
    batch = generate(tiny_model, prompts, config)
    for prompt, request in zip(prompts, batch.requests, strict=True):
        alone = generate(tiny_model, [prompt], config).requests[0]
        assert request.token_ids == alone.token_ids
        assert request.prompt_token_ids == prompt


def test_generation_stops_at_eos_and_keeps_it_like_transformers() -> None:
    loaded = tiny_llama()
    prompt = _prompts(8)[0]
    free = generate(loaded, [prompt], GenerationConfig(max_new_tokens=30, ignore_eos=True)).requests[0].token_ids
    # Declare a token greedy decoding produces to be end-of-sequence; both engines must stop on it.
    eos = free[6]
    loaded.model.generation_config.eos_token_id = eos
    request = generate(loaded, [prompt], GenerationConfig(max_new_tokens=30)).requests[0]
    assert request.stop_reason == "eos"
    assert request.token_ids == free[: free.index(eos) + 1]
    assert request.token_ids == transformers_greedy(loaded, prompt, 30)


def test_ignore_eos_generates_exactly_max_new_tokens() -> None:
    loaded = tiny_llama()
    prompt = _prompts(8)[0]
    free = generate(loaded, [prompt], GenerationConfig(max_new_tokens=12, ignore_eos=True)).requests[0]
    loaded.model.generation_config.eos_token_id = free.token_ids[0]
    output = generate(loaded, [prompt], GenerationConfig(max_new_tokens=12, ignore_eos=True))
    assert output.requests[0].token_ids == free.token_ids and output.requests[0].stop_reason == "length"


def test_stop_string_cuts_the_text_and_ends_the_row() -> None:
    loaded = tiny_llama()
    prompt = _prompts(9)[0]
    free = generate(loaded, [prompt], GenerationConfig(max_new_tokens=20, ignore_eos=True)).requests[0]
    stop_word = loaded.tokenizer.decode([free.token_ids[5]])
    stopped = generate(
        loaded, [prompt], GenerationConfig(max_new_tokens=20, ignore_eos=True, stop_strings=(stop_word,))
    ).requests[0]
    first = free.token_ids.index(free.token_ids[5])
    assert stopped.stop_reason == "stop_string"
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stop_word not in stopped.text


def test_sampling_is_reproducible_for_a_seed_and_changes_with_it() -> None:
    loaded = tiny_llama()
    prompt = _prompts(10)[0]
    config = GenerationConfig(max_new_tokens=30, temperature=1.5, seed=11, ignore_eos=True)
    first = generate(loaded, [prompt], config).requests[0].token_ids
    again = generate(loaded, [prompt], config).requests[0].token_ids
    other = generate(loaded, [prompt], GenerationConfig(max_new_tokens=30, temperature=1.5, seed=12, ignore_eos=True))
    assert first == again
    assert first != other.requests[0].token_ids


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = token_probabilities(logits, temperature=1.0, top_p=0.8)
    torch.testing.assert_close(probs, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))
    probs = token_probabilities(logits, temperature=1.0, top_p=0.81)
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    only_best = token_probabilities(logits, temperature=1.0, top_p=0.01)
    assert only_best.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_sampled_tokens_follow_the_distribution() -> None:
    from kvlab.generation import select_next_tokens

    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).expand(20000, 3)
    generator = torch.Generator().manual_seed(0)
    tokens = select_next_tokens(logits, GenerationConfig(temperature=1.0), generator)
    frequencies = torch.bincount(tokens, minlength=3).float() / tokens.numel()
    # Three standard errors of a 20k-sample frequency are below 0.011.
    torch.testing.assert_close(frequencies, torch.tensor([0.6, 0.3, 0.1]), atol=0.011, rtol=0)


def test_stats_count_tokens_and_time() -> None:
    loaded = tiny_llama()
    prompts = _prompts(6, 9)
    output = generate(loaded, prompts, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    stats = output.stats
    assert stats.prompt_tokens == 15 and stats.new_tokens == 16
    assert stats.ttft_s > 0 and stats.decode_s > 0 and stats.decode_tokens_per_s > 0
    assert stats.kv_bytes == (15 + 2 * 7) * loaded.architecture.kv_bytes_per_token(element_size=2)
    assert stats.kv_bytes_ratio == 1.0


@pytest.mark.parametrize(
    ("prompts", "config", "message"),
    [
        ([[]], GenerationConfig(max_new_tokens=4), "empty"),
        ([[5] * 500], GenerationConfig(max_new_tokens=20), "exceeds the model's context of 512"),
        ([], GenerationConfig(), "no prompts"),
    ],
)
def test_bad_prompts_are_refused_with_a_clear_error(
    prompts: list[list[int]],
    config: GenerationConfig,
    message: str,
) -> None:
    with pytest.raises(ConfigError, match=message):
        generate(tiny_llama(), prompts, config)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p")],
)
def test_bad_generation_settings_are_refused(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GenerationConfig(**kwargs)  # type: ignore[arg-type]
