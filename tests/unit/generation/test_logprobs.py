"""Log-probabilities, `min_tokens` and stop tokens: the pure functions, and the engine with them on a tiny model."""

from __future__ import annotations

import pytest
import torch

from kvlab.compress import compressors
from kvlab.engine import Engine, Request
from kvlab.generation import GenerationConfig
from kvlab.generation.logprobs import score_tokens
from kvlab.generation.reference import reference_generate
from kvlab.generation.sampling import suppress_stop_tokens
from kvlab.generation.stopping import StopChecker, cut_at_stop
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel
from tests.helpers import TINY_EOS, plain_attention, tiny_llama

PROMPT = "w5 w9 w17 w33 w40 w41 w60 w7 w8 w12 w13 w50 w51 w52 w70 w71 w3 w4 w6 w10"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny_llama()


def run(loaded: LoadedModel, request: Request):  # type: ignore[no-untyped-def]
    engine = Engine(loaded)
    request_id = engine.add_request(request)
    while engine.has_work():
        engine.step()
    return engine.output(request_id)


def test_scores_are_log_softmax_and_the_best_token_equals_its_top_alternative() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    scores = score_tokens(logits, [0, 2], num_top=2)
    expected = torch.log_softmax(logits, dim=-1)
    assert scores.logprobs == [expected[0, 0].item(), expected[1, 2].item()]
    assert [token for token, _ in scores.top[1]] == [1, 2]
    assert scores.top[0][0] == (0, scores.logprobs[0])  # exactly equal: lm-eval's is_greedy compares floats
    assert score_tokens(logits, [0, 2], num_top=0).top == [[], []]
    with pytest.raises(ValueError, match="rows of logits"):
        score_tokens(logits, [0], num_top=0)


def test_stop_tokens_are_suppressed_only_in_rows_before_min_tokens() -> None:
    logits = torch.zeros(3, 5)
    config = GenerationConfig(min_tokens=4)
    suppressed = suppress_stop_tokens(logits, num_generated=2, config=config, stop_token_ids=(1, 3))
    assert torch.isinf(suppressed[:2, [1, 3]]).all() and not torch.isinf(suppressed[2]).any()
    assert not torch.isinf(suppressed[:, [0, 2, 4]]).any()
    assert suppress_stop_tokens(logits, 4, config, (1, 3)) is logits
    assert not torch.isinf(suppress_stop_tokens(logits, 0, config, (10**9,))).any()  # past the vocabulary


def test_stop_checker_waits_for_min_tokens_and_stops_on_stop_token_ids() -> None:
    def decode(ids: list[int]) -> str:
        return " ".join(map(str, ids))

    checker = StopChecker(GenerationConfig(min_tokens=3, stop_strings=("9",)), (2,), decode)
    assert checker.check([2]) is None and checker.check([5, 9]) is None and checker.check([5, 7, 2]) == "eos"
    stop_ids = StopChecker(GenerationConfig(ignore_eos=True, stop_token_ids=(7,)), (2,), decode)
    assert stop_ids.check([2]) is None and stop_ids.check([7]) == "eos" and stop_ids.ending_token_ids == (7,)
    assert cut_at_stop("a STOP b", ("STOP",), include_stop=True) == "a STOP"
    assert cut_at_stop("a STOP b", ("STOP",), include_stop=False) == "a "


def test_engine_scores_equal_transformers_log_softmax(loaded: LoadedModel) -> None:
    prompt = loaded.encode_prompt(PROMPT, raw=True)
    config = GenerationConfig(max_new_tokens=6, logprobs=3, prompt_logprobs=2, prefill_chunk_tokens=8)
    output = run(loaded, Request(prompt, config))
    assert output.prompt_logprobs is not None and output.logprobs is not None
    assert output.prompt_logprobs.token_ids == prompt[1:] and output.logprobs.token_ids == output.token_ids
    with torch.no_grad(), plain_attention(loaded):
        logits = loaded.model(input_ids=torch.tensor([prompt + output.token_ids])).logits[0].float()
    ids = torch.tensor(prompt + output.token_ids)
    expected = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, ids[1:, None])[:, 0]
    got = torch.tensor(output.prompt_logprobs.logprobs + output.logprobs.logprobs)
    # fp32, kvlab's attention against transformers' SDPA: the same sums in another order.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert all(len(top) == 3 for top in output.logprobs.top)
    assert all(len(top) == 2 for top in output.prompt_logprobs.top)


VERIFY_SCORE_TOLERANCE = 1e-4
"""Absolute tolerance between a generated token's lossless and plain log-probabilities. Lossless decoding scores
its tokens in a verify forward over several tokens, plain decoding in one-token forwards: the same fp32 sums
through matrix products of other shapes, which may round differently (the embedded model's differ by up to
1.3e-5; this tiny model's happened to agree bit for bit where measured). Tokens and prompt scores stay exact."""


def test_lossless_scores_match_plain_within_a_tolerance_and_lossy_ones_are_its_own(loaded: LoadedModel) -> None:
    prompt = loaded.encode_prompt(PROMPT, raw=True)
    config = GenerationConfig(max_new_tokens=10, logprobs=1, prompt_logprobs=1, prefill_chunk_tokens=8)
    plain = run(loaded, Request(prompt, config))
    lossless = run(loaded, Request(prompt, config, lossless=LosslessConfig(compressors.create("snapkv", budget=6), 3)))
    lossy = run(loaded, Request(prompt, config, compressors.create("streamingllm", budget=6, num_sinks=2)))
    assert lossless.token_ids == plain.token_ids
    assert lossless.prompt_logprobs == plain.prompt_logprobs  # the same prefill, bit for bit
    assert plain.logprobs is not None and lossless.logprobs is not None and lossy.logprobs is not None
    torch.testing.assert_close(torch.tensor(lossless.logprobs.logprobs), torch.tensor(plain.logprobs.logprobs),
                               rtol=0, atol=VERIFY_SCORE_TOLERANCE)
    assert lossy.logprobs.logprobs != plain.logprobs.logprobs  # read from the compressed cache
    assert lossy.logprobs.token_ids == lossy.token_ids


@pytest.mark.parametrize("mode", ["plain", "lossless"])
def test_min_tokens_keeps_eos_out_until_reached_as_the_reference_does(loaded: LoadedModel, mode: str) -> None:
    prompt = loaded.encode_prompt(PROMPT, raw=True)
    # Make the tiny model's end token likely: it is then chosen at once without min_tokens.
    eos_prompt = prompt + [TINY_EOS] * 3
    base = GenerationConfig(max_new_tokens=12, stop_token_ids=(int(run(loaded, Request(eos_prompt)).token_ids[0]),))
    first = run(loaded, Request(eos_prompt, base))
    assert first.stop_reason == "eos" and len(first.token_ids) == 1
    config = GenerationConfig(max_new_tokens=12, min_tokens=5, stop_token_ids=base.stop_token_ids)
    lossless = LosslessConfig(compressors.create("snapkv", budget=6), 3) if mode == "lossless" else None
    output = run(loaded, Request(eos_prompt, config, lossless=lossless))
    assert len(output.token_ids) >= 5
    assert not set(output.token_ids[:4]) & {TINY_EOS, *config.stop_token_ids}
    assert output.token_ids == reference_generate(loaded, [eos_prompt], config).requests[0].token_ids
