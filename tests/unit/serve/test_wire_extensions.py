"""What lm-eval, `vllm bench serve` and guidellm send, in process on a tiny model: prompts in every
shape, echo and log-probabilities, vLLM's sampling extensions, stream chunk order, /tokenize, metric names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvlab.models import LoadedModel
from tests.helpers import TINY_EOS, tiny_llama
from tests.unit.serve.test_app import events, make_client

# Words the tiny tokenizer keeps whole (its text round-trips through the token ids).
PROMPT = " ".join(f"w{i}" for i in (5, 9, 33, 40, 41, 60, 7, 8, 50, 51, 52, 70, 71, 3, 4, 6))
# A run of end tokens makes the tiny model's end token likely.
EOS_PROMPT = PROMPT + " w2 w2 w2"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny_llama()


@pytest.fixture(scope="module")
def client(loaded: LoadedModel) -> Iterator[TestClient]:
    with make_client(loaded, max_prompt_tokens=64) as client:
        yield client


def complete(client: TestClient, **body: Any) -> dict[str, Any]:
    reply = client.post("/v1/completions", json={"temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def refused(client: TestClient, route: str = "/v1/completions", **body: Any) -> str:
    reply = client.post(route, json=body)
    assert reply.status_code == 400, reply.text
    return str(reply.json()["error"]["message"])


def test_token_id_batches_give_one_choice_per_prompt(client: TestClient, loaded: LoadedModel) -> None:
    prompts = [loaded.encode_prompt(PROMPT, raw=True), loaded.encode_prompt("w3 w4 w5 w6", raw=True)]
    batch = complete(client, prompt=prompts, max_tokens=5)
    alone = [complete(client, prompt=prompt, max_tokens=5)["choices"][0]["text"] for prompt in prompts]
    assert [choice["index"] for choice in batch["choices"]] == [0, 1]
    assert [choice["text"] for choice in batch["choices"]] == alone
    strings = complete(client, prompt=[PROMPT, "w3 w4 w5 w6"], max_tokens=5)
    assert [choice["text"] for choice in strings["choices"]] == alone
    assert batch["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert [figures["prompt_tokens"] for figures in batch["kvlab"]] == [len(p) for p in prompts]


@pytest.mark.parametrize("prompt", [{"text": "w3"}, [], [[]], [1, "w3"], [[1], "w3", [True]], 3])
def test_other_prompt_shapes_are_refused_naming_the_accepted_ones(client: TestClient, prompt: Any) -> None:
    assert "a string, a list of strings, a list of token ids, or a list of token-id lists" in refused(
        client, prompt=prompt) or "empty" in refused(client, prompt=prompt)


def test_echo_with_logprobs_scores_the_prompt_and_the_generated_tokens(client: TestClient, loaded: LoadedModel) -> None:
    prompt = loaded.encode_prompt(PROMPT, raw=True)
    body = complete(client, prompt=[prompt], max_tokens=1, logprobs=2, echo=True)
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + 1 and choice["text"].startswith(PROMPT)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(value, float) for value in logprobs["token_logprobs"][1:])
    # Each position's alternatives hold the two most likely tokens and the token itself.
    for token, value, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:],
                                 strict=True):
        assert top[token] == value and 2 <= len(top) <= 3 and max(top.values()) >= value
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    scored = complete(client, prompt=[prompt], max_tokens=0, logprobs=0, echo=True)["choices"][0]
    assert scored["text"] == PROMPT and scored["finish_reason"] == "length"
    assert scored["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:-1]
    assert "max_tokens=0 needs echo=true" in refused(client, prompt=PROMPT, max_tokens=0)


def test_chat_logprobs_need_logprobs_true(client: TestClient) -> None:
    assert "top_logprobs needs logprobs=true" in refused(
        client, "/v1/chat/completions", messages=[{"role": "user", "content": "w3"}], top_logprobs=2)


def test_min_tokens_keeps_stop_tokens_out_until_reached(client: TestClient) -> None:
    first = complete(client, prompt=PROMPT, max_tokens=12, logprobs=0)["choices"][0]["logprobs"]["tokens"][0]
    stop_ids = [int(first.removeprefix("w")), TINY_EOS]
    short = complete(client, prompt=PROMPT, max_tokens=12, stop_token_ids=stop_ids)
    assert short["usage"]["completion_tokens"] == 1 and short["choices"][0]["finish_reason"] == "stop"
    held = complete(client, prompt=PROMPT, max_tokens=12, min_tokens=6, stop_token_ids=stop_ids, logprobs=0)
    tokens = held["choices"][0]["logprobs"]["tokens"]
    assert held["usage"]["completion_tokens"] >= 6 and not {f"w{i}" for i in stop_ids} & set(tokens[:5])


def test_ignore_eos_and_stop_token_ids(client: TestClient) -> None:
    assert complete(client, prompt=EOS_PROMPT, max_tokens=10)["choices"][0]["finish_reason"] == "stop"
    assert complete(client, prompt=EOS_PROMPT, max_tokens=10, ignore_eos=True)["usage"]["completion_tokens"] == 10
    free = complete(client, prompt=PROMPT, max_tokens=8, ignore_eos=True, logprobs=0)["choices"][0]
    third = int(free["logprobs"]["tokens"][2].removeprefix("w"))
    stopped = complete(client, prompt=PROMPT, max_tokens=8, ignore_eos=True, stop_token_ids=[third])
    assert stopped["usage"]["completion_tokens"] == free["logprobs"]["tokens"].index(f"w{third}") + 1
    assert stopped["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_and_skip_special_tokens(client: TestClient) -> None:
    free = complete(client, prompt=PROMPT, max_tokens=8, ignore_eos=True)["choices"][0]["text"]
    stop = free.split()[3]
    cut = complete(client, prompt=PROMPT, max_tokens=8, ignore_eos=True, stop=[stop])["choices"][0]["text"]
    kept = complete(client, prompt=PROMPT, max_tokens=8, ignore_eos=True, stop=[stop],
                    include_stop_str_in_output=True)["choices"][0]["text"]
    assert kept == cut + stop and not cut.endswith(stop)
    hidden = complete(client, prompt=EOS_PROMPT, max_tokens=8, ignore_eos=True, logprobs=0)["choices"][0]
    shown = complete(client, prompt=EOS_PROMPT, max_tokens=8, ignore_eos=True, skip_special_tokens=False)["choices"][0]
    assert f"w{TINY_EOS}" in hidden["logprobs"]["tokens"], "the prompt no longer leads the tiny model to its end token"
    assert f"w{TINY_EOS}" in shown["text"].split() and f"w{TINY_EOS}" not in hidden["text"].split()


@pytest.mark.parametrize(("field", "value"), [("repetition_penalty", 1.1), ("top_k", 5), ("min_p", 0.1),
                                              ("presence_penalty", 0.5)])
def test_non_neutral_extensions_are_refused_by_name(client: TestClient, field: str, value: float) -> None:
    assert field in refused(client, prompt=PROMPT, **{field: value})
    complete(client, prompt=PROMPT, max_tokens=1, repetition_penalty=1.0, top_k=-1, min_p=0.0)


def stream(client: TestClient, route: str, **body: Any) -> list[dict[str, Any]]:
    reply = client.post(route, json={"temperature": 0, "stream": True, **body})
    assert reply.status_code == 200, reply.text
    return [json.loads(data) for data in events(reply.text)[:-1]]


def test_streams_start_on_the_first_token_and_end_on_the_last(client: TestClient) -> None:
    # Chat streams, whose role rides on the first token, are tested on the embedded model (the tiny one
    # has no chat template): tests/integration/test_serve/test_wire.py.
    with_choices = [c for c in stream(client, "/v1/completions", prompt=PROMPT, max_tokens=5, ignore_eos=True)
                    if c["choices"]]
    first, last = with_choices[0]["choices"][0], with_choices[-1]["choices"][0]
    assert first["text"], "the first chunk must carry the first token"
    assert last["finish_reason"] == "length" and last["text"], "finish_reason rides on the last token's chunk"
    assert all(c["choices"][0]["finish_reason"] is None for c in with_choices[:-1])


def test_continuous_usage_stats_put_usage_in_every_chunk(client: TestClient) -> None:
    chunks = stream(client, "/v1/completions", prompt=PROMPT, max_tokens=4, ignore_eos=True,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert all(chunk["usage"] is not None for chunk in chunks) and counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1]["choices"] == []


def test_tokenize_and_detokenize_round_trip(client: TestClient, loaded: LoadedModel) -> None:
    reply = client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert reply["tokens"] == loaded.encode_prompt(PROMPT, raw=True) and reply["count"] == len(reply["tokens"])
    assert reply["token_strs"] == PROMPT.split()
    assert client.post("/detokenize", json={"tokens": reply["tokens"]}).json() == {"prompt": PROMPT}
    assert "token ids must be in" in refused(client, "/detokenize", tokens=[10**6])


def test_token_ids_past_the_vocabulary_or_the_context_are_refused(client: TestClient, loaded: LoadedModel) -> None:
    # A stop token past the vocabulary would index past the logits when min_tokens suppresses it.
    assert "stop_token_ids must be in" in refused(client, prompt=PROMPT, min_tokens=2, stop_token_ids=[10**9])
    too_many = [3] * (loaded.architecture.max_context + 1)
    assert "the model's context" in refused(client, "/detokenize", tokens=too_many)


def test_metric_names_can_be_vllms(loaded: LoadedModel) -> None:
    with make_client(loaded, metrics_prefix="vllm") as client:
        text = client.get("/metrics").text
    assert "vllm:spec_decode_num_drafts_total" in text and "kvlab:" not in text
