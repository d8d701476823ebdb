"""`kvlab serve` on the embedded model, as evaluation and load-test clients read it: echo + logprobs equal
transformers' log_softmax (openai client and raw HTTP), lossless scores match plain ones (the prompt's exactly,
generated tokens' within a tolerance), lossy scores are kvlab's own lossy decode; chat streams carry the role
with the first token and log-probabilities."""

from __future__ import annotations

import functools
from typing import Any

import openai
import pytest
import torch

from kvlab.compress import compressors
from kvlab.engine import Engine, Request
from kvlab.generation import GenerationConfig, RequestOutput
from kvlab.models import LoadedModel, load_model
from tests.helpers import plain_attention
from tests.integration.test_serve.server import ServeProcess
from tests.integration.test_serve.test_api import MODES, PASSAGE

pytestmark = pytest.mark.integration

NEW_TOKENS = 6
# The server's default prefill pieces: the offline runs below cut the prompt the same way.
PREFILL_CHUNK_TOKENS = 512
VERIFY_SCORE_TOLERANCE = 1e-4
"""Absolute tolerance between a generated token's lossless and plain log-probabilities: lossless decoding scores
its tokens in a verify forward over several tokens, plain decoding in one-token forwards, and matrix products of
other shapes round the same fp32 sums differently (measured: up to 1.3e-5 apart on this model)."""


@functools.cache
def embedded() -> LoadedModel:
    return load_model(None)


def transformers_logprobs(token_ids: list[int]) -> list[float]:
    """log_softmax of transformers' own logits (SDPA) at each position, for the token that follows."""
    loaded = embedded()
    with torch.no_grad(), plain_attention(loaded):
        logits = loaded.model(input_ids=torch.tensor([token_ids])).logits[0].float()
    ids = torch.tensor(token_ids)
    return torch.log_softmax(logits, dim=-1)[:-1].gather(-1, ids[1:, None])[:, 0].tolist()


def scored(server: ServeProcess, kvlab: dict[str, Any], max_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    status, body = server.post("/v1/completions", {
        "prompt": PASSAGE, "max_tokens": max_tokens, "temperature": 0, "echo": True, "logprobs": 2, "kvlab": kvlab,
    })
    assert status == 200, body
    return body["choices"][0]  # type: ignore[no-any-return]


def test_echo_logprobs_equal_transformers_through_raw_http_and_the_openai_client(
    server: ServeProcess, client: openai.OpenAI
) -> None:
    raw = scored(server, {"mode": "plain"})
    prompt = embedded().encode_prompt(PASSAGE, raw=True)
    reply = client.completions.create(model="smollm2", prompt=PASSAGE, max_tokens=NEW_TOKENS, temperature=0,
                                      echo=True, logprobs=2)
    via_client = reply.choices[0].logprobs
    assert via_client is not None and via_client.token_logprobs == raw["logprobs"]["token_logprobs"]
    assert via_client.tokens == raw["logprobs"]["tokens"] and reply.choices[0].text == raw["text"]
    values = raw["logprobs"]["token_logprobs"]
    assert values[0] is None and len(values) == len(prompt) + NEW_TOKENS
    tokens = prompt + offline(prompt, None).token_ids
    # fp32; kvlab's attention and prefill pieces against transformers' one SDPA forward.
    torch.testing.assert_close(torch.tensor(values[1:]), torch.tensor(transformers_logprobs(tokens)), rtol=0, atol=2e-4)


def offline(prompt: list[int], mode: str | None) -> RequestOutput:
    """kvlab's own decode of the prompt, scored as `scored` asks (echo scores the prompt too, which computes
    every position's logits in one product: the last row's bits may differ from a one-row product's)."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, prefill_chunk_tokens=PREFILL_CHUNK_TOKENS, logprobs=2,
                              prompt_logprobs=2)
    compressor = None
    if mode == "lossy":
        compressor = compressors.create("snapkv", **MODES["lossy"][0]["drafter_args"])
    engine = Engine(embedded())
    request_id = engine.add_request(Request(prompt, config, compressor))
    while engine.has_work():
        engine.step()
    return engine.output(request_id)


def test_lossless_scores_match_plain_within_a_tolerance_and_lossy_scores_are_its_own_decode(
    server: ServeProcess,
) -> None:
    plain, lossless, lossy = (scored(server, MODES[mode][0]) for mode in ("plain", "lossless", "lossy"))
    prompt = embedded().encode_prompt(PASSAGE, raw=True)
    num_prompt = len(prompt)
    # The prompt's scores come from the same prefill in every mode (compression starts after the prompt).
    assert lossless["logprobs"]["token_logprobs"][:num_prompt] == plain["logprobs"]["token_logprobs"][:num_prompt]
    assert lossless["text"] == plain["text"]
    torch.testing.assert_close(
        torch.tensor(lossless["logprobs"]["token_logprobs"][num_prompt:]),
        torch.tensor(plain["logprobs"]["token_logprobs"][num_prompt:]), rtol=0, atol=VERIFY_SCORE_TOLERANCE)
    own = offline(prompt, "lossy")
    assert own.logprobs is not None and lossy["text"] == PASSAGE + own.text
    assert lossy["logprobs"]["token_logprobs"][num_prompt:] == own.logprobs.logprobs
    assert lossy["logprobs"]["token_logprobs"][num_prompt:] != plain["logprobs"]["token_logprobs"][num_prompt:]


def test_a_chat_stream_carries_the_role_and_logprobs_with_its_first_token(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name three primary colors."}], max_tokens=NEW_TOKENS,
        temperature=0, stream=True, logprobs=True, top_logprobs=2, stream_options={"include_usage": True},
    ))
    with_choices = [chunk for chunk in chunks if chunk.choices]
    first, last = with_choices[0].choices[0], with_choices[-1].choices[0]
    assert first.delta.role == "assistant" and first.delta.content, "the role chunk must carry the first token"
    assert all(chunk.choices[0].delta.role is None for chunk in with_choices[1:])
    assert last.finish_reason is not None and all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    entries = [entry for chunk in with_choices for entry in (chunk.choices[0].logprobs.content or [])]
    assert len(entries) == chunks[-1].usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in entries)
