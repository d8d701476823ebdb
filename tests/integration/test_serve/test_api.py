"""`kvlab serve` on the embedded model through the real openai client: greedy texts equal offline
`kvlab generate` in every mode, streamed or not; concurrency changes no text; seeded sampling repeats;
a disconnect frees the row; metrics parse."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_serve.server import ServeProcess, offline_text

pytestmark = pytest.mark.integration

QUESTION = "Name three primary colors."
# Long enough that a SnapKV cache with an 8-token window evicts part of it (lossy output may differ).
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
    "great lens and wound the clockwork that turned the light. Ships far out at sea counted the flashes to "
    "know which coast they were passing. One winter night a storm broke the glass of the lantern room, and"
)
MAX_TOKENS = 12
MODES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "plain": ({"mode": "plain"}, []),
    "lossy": (
        {"mode": "lossy", "drafter": "snapkv", "drafter_args": {"compression_ratio": 0.5, "window_size": 8}},
        ["--compressor", "snapkv", "--compressor-arg", "compression_ratio=0.5", "--compressor-arg", "window_size=8"],
    ),
    "lossless": (
        {"mode": "lossless", "drafter": "snapkv", "drafter_args": {"compression_ratio": 0.5, "window_size": 8},
         "draft_length": 4},
        ["--lossless", "--drafter", "snapkv", "--drafter-arg", "compression_ratio=0.5", "--drafter-arg",
         "window_size=8", "--num-draft-tokens", "4"],
    ),
}


def chat(client: openai.OpenAI, content: str, kvlab: dict[str, Any], stream: bool, **extra: Any) -> str:
    messages = [{"role": "user", "content": content}]
    body = {"model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "extra_body": {"kvlab": kvlab}}
    if not stream:
        reply = client.chat.completions.create(**body, **extra)  # type: ignore[call-overload]
        return str(reply.choices[0].message.content)
    chunks = client.chat.completions.create(**body, stream=True, **extra)  # type: ignore[call-overload]
    parts = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    return "".join(parts)


def complete(client: openai.OpenAI, prompt: str, kvlab: dict[str, Any], stream: bool) -> str:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "extra_body": {"kvlab": kvlab}}
    if not stream:
        return str(client.completions.create(**body).choices[0].text)  # type: ignore[call-overload]
    chunks = client.completions.create(**body, stream=True)  # type: ignore[call-overload]
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_texts_equal_offline_generate_streamed_or_not(client: openai.OpenAI, mode: str) -> None:
    kvlab, flags = MODES[mode]
    max_tokens = ["--max-new-tokens", str(MAX_TOKENS)]
    expected_chat = offline_text("--prompt", QUESTION, *max_tokens, *flags)
    expected_raw = offline_text("--prompt", PASSAGE, "--raw", *max_tokens, *flags)
    # Streamed and whole replies alternate over the modes, so each endpoint is checked both ways.
    stream = mode == "lossless"
    assert chat(client, QUESTION, kvlab, stream) == expected_chat, (
        f"{mode} chat (stream={stream}) differs from kvlab generate")
    assert complete(client, PASSAGE, kvlab, not stream) == expected_raw, (
        f"{mode} completion (stream={not stream}) differs")


def test_lossless_reply_reports_its_rounds_and_usage(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="smollm2", prompt=PASSAGE, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"kvlab": MODES["lossless"][0]},
    )
    stats = reply.model_extra["kvlab"]  # type: ignore[index]
    assert stats["mode"] == "lossless" and stats["drafter"] == "snapkv"
    assert stats["rounds"] > 0 and stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    expected_length = (stats["num_accepted_tokens"] + stats["rounds"]) / stats["rounds"]
    assert stats["acceptance_length"] == pytest.approx(expected_length)
    assert reply.usage is not None and reply.usage.completion_tokens == stats["completion_tokens"]
    assert reply.usage.prompt_tokens_details is not None and reply.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_usage_comes_last_when_asked(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=5, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, "the last chunk must carry only the usage"
    assert chunks[-1].usage.completion_tokens == 5
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_eight_concurrent_clients_get_the_texts_of_sequential_ones(client: openai.OpenAI) -> None:
    prompts = [f"Write one sentence about the number {n}." for n in range(8)]
    kvlabs = [MODES["lossless"][0] if n % 2 else MODES["plain"][0] for n in range(8)]
    sequential = [chat(client, p, k, stream=False) for p, k in zip(prompts, kvlabs, strict=True)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        concurrent_ = list(pool.map(lambda args: chat(client, args[0], args[1], stream=bool(args[2] % 2)),
                                    [(p, k, n) for n, (p, k) in enumerate(zip(prompts, kvlabs, strict=True))]))
    for n, (alone, together) in enumerate(zip(sequential, concurrent_, strict=True)):
        assert alone == together, f"client {n}: its text changed when 8 clients ran at once"


def test_sampling_with_a_seed_repeats_per_request(client: openai.OpenAI) -> None:
    def sample(mode: str) -> str:
        return str(client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0.9,
            top_p=0.95, seed=1234, extra_body={"kvlab": MODES[mode][0]},
        ).choices[0].message.content)

    for mode in ("plain", "lossless"):
        alone = sample(mode)
        with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
            neighbours = [pool.submit(chat, client, f"Count to {n}.", {}, False) for n in (3, 4)]
            beside_others = sample(mode)
            for future in neighbours:
                future.result()
        assert alone == beside_others, f"{mode}: the same seed sampled another text beside other requests"


def test_a_client_that_disconnects_mid_stream_frees_its_row(server: ServeProcess, client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="smollm2", prompt=PASSAGE, max_tokens=1500, temperature=0.0, stream=True,
        extra_body={"kvlab": {"mode": "lossless", "ignore_eos": True}},
    )
    for _, _chunk in zip(range(3), stream, strict=False):  # the first three chunks only
        pass
    assert server.metric("kvlab:num_requests_running") == 1
    stream.close()
    deadline = time.monotonic() + 20
    while server.metric("kvlab:num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("kvlab:num_requests_running") == 0, "the disconnected request still holds its row"
    assert server.metric("kvlab:request_failure_total") >= 1


def test_metrics_parse_and_count_drafts_tokens_and_latencies(server: ServeProcess, client: openai.OpenAI) -> None:
    complete(client, PASSAGE, MODES["lossless"][0], stream=False)
    status, text = server.get("/metrics")
    assert status == 200
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("kvlab:spec_decode_num_draft_tokens", "kvlab:spec_decode_num_accepted_tokens",
                 "kvlab:prefix_fetched_tokens", "kvlab:prefix_recomputed_tokens", "kvlab:num_requests_waiting",
                 "kvlab:time_to_first_token_seconds", "kvlab:inter_token_latency_seconds"):
        assert name in families, f"{name} missing from /metrics"
    assert server.metric("kvlab:spec_decode_num_draft_tokens_total") > 0
    accepted = server.metric("kvlab:spec_decode_num_accepted_tokens_total")
    assert accepted <= server.metric("kvlab:spec_decode_num_draft_tokens_total")
    assert server.metric("kvlab:time_to_first_token_seconds_count") > 0
    assert server.metric("kvlab:prefix_recomputed_tokens_total") > 0


def test_models_and_health(server: ServeProcess, client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == ["smollm2"]
    assert server.get("/health") == (200, '{"status":"ok"}')


def test_page_is_served(server: ServeProcess, tmp_path: Path) -> None:
    status, html = server.get("/")
    assert status == 200 and 'id="prompt"' in html and "smollm2" in html
