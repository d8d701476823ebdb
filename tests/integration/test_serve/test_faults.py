"""`kvlab serve` limits and faults: the API key, 429 past the queue, 400s for malformed requests, a
prefix store that goes down, and SIGTERM while a request streams."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvlab.cli import main
from tests.helpers import RedisServer
from tests.integration.test_serve.server import ServeProcess
from tests.integration.test_serve.test_api import PASSAGE

pytestmark = pytest.mark.integration

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One running slot, no queue, short prompts; the key comes from the environment."""
    process = ServeProcess(
        tmp_path_factory.mktemp("guarded"), "--max-num-seqs", "1", "--max-queued-requests", "0",
        "--max-prompt-tokens", "40", "--max-tokens-limit", "512", env={"KVLAB_API_KEY": KEY},
    )
    yield process
    process.stop()


def client_for(server: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_binding_beyond_loopback_needs_an_api_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("KVLAB_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err


def test_the_api_key_is_enforced(guarded: ServeProcess) -> None:
    for key in ("wrong-key", KEY[:-1], KEY + "x"):
        with pytest.raises(openai.AuthenticationError):
            client_for(guarded, key).models.list()
    status, body = guarded.post("/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert [model.id for model in client_for(guarded, KEY).models.list()] == ["smollm2"]


def test_requests_beyond_the_running_batch_and_the_queue_get_429(guarded: ServeProcess) -> None:
    client = client_for(guarded, KEY)
    stream = client.completions.create(
        model="smollm2", prompt="Once upon a time", max_tokens=400, temperature=0.0, stream=True,
        extra_body={"kvlab": {"ignore_eos": True}},
    )
    next(iter(stream))
    with pytest.raises(openai.RateLimitError, match="at capacity"):
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
    stream.close()
    deadline = time.monotonic() + 20
    while guarded.metric("kvlab:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.completions.create(model="smollm2", prompt="Hello", max_tokens=2).choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        ({"prompt": "hi", "max_tokens": 2, "temperatur": 0}, "temperatur: unknown field"),
        ({"prompt": "hi", "kvlab": {"mode": "lossless", "draft_len": 3}}, "kvlab.draft_len: unknown field"),
        ({"prompt": "hi", "kvlab": {"mode": "fast"}}, "kvlab.mode"),
        ({"prompt": "hi", "kvlab": {"mode": "lossless", "drafter": "nope"}}, "unknown compressor 'nope'"),
        ({"prompt": "hi", "kvlab": {"mode": "lossless", "drafter_args": {"bogus": 1}}}, "has no parameter 'bogus'"),
        ({"prompt": "hi", "kvlab": {"drafter": "snapkv"}}, "need mode 'lossy' or 'lossless'"),
        ({"prompt": "hi", "n": 2}, "only n=1"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "max_tokens": 1000}, "max_tokens_limit"),
        ({"prompt": PASSAGE}, "at most 40 (max_prompt_tokens)"),
        ({"prompt": ""}, "empty"),
        ({"max_tokens": 2}, "prompt: Field required"),
    ],
)
def test_malformed_requests_get_400_with_an_openai_error_object(
    guarded: ServeProcess, body: object, message: str
) -> None:
    status, reply = guarded.post("/v1/completions", body, {"Authorization": f"Bearer {KEY}"})  # type: ignore[arg-type]
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error"
    assert message in reply["error"]["message"]


def test_an_unknown_model_is_404(guarded: ServeProcess) -> None:
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client_for(guarded, KEY).completions.create(model="gpt-5", prompt="hi", max_tokens=1)


def test_a_store_that_goes_down_mid_request_costs_reuse_not_completion(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path)
    server = ServeProcess(tmp_path, "--prefix-store", redis.url, "--prefix-chunk-tokens", "16")
    try:
        client = client_for(server, "unused")

        def ask(prompt: str) -> openai.types.Completion:
            return client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0.0)

        first = ask(PASSAGE)
        details = first.usage.prompt_tokens_details if first.usage else None
        assert details and details.cached_tokens == 0
        deadline = time.monotonic() + 30  # chunks are written in the background
        while True:
            again = ask(PASSAGE)
            assert again.usage and again.usage.prompt_tokens_details
            if again.usage.prompt_tokens_details.cached_tokens or time.monotonic() > deadline:
                break
        assert again.usage.prompt_tokens_details.cached_tokens >= 16, "the stored prefix was never reused"
        assert again.choices[0].text == first.choices[0].text, "a restored prefix changed the text"

        stream = client.completions.create(
            model="smollm2", prompt=PASSAGE + " The keeper", max_tokens=24, temperature=0.0, stream=True,
            extra_body={"kvlab": {"mode": "lossless", "ignore_eos": True}},
        )
        chunks = iter(stream)
        next(chunks)
        redis.stop()
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length", "the request did not complete after the store went down"

        down = ask(PASSAGE)
        assert down.usage and down.usage.prompt_tokens_details and down.usage.prompt_tokens_details.cached_tokens == 0
        assert down.choices[0].text == first.choices[0].text, "recomputing after a store fault changed the text"
    finally:
        server.stop()
        redis.stop()


def test_sigterm_finishes_the_running_request_flushes_prefix_writes_and_exits_0(tmp_path: Path) -> None:
    store = tmp_path / "store"
    server = ServeProcess(tmp_path, "--prefix-store", f"file://{store}", "--prefix-chunk-tokens", "16")
    try:
        stream = client_for(server, "unused").completions.create(
            model="smollm2", prompt=PASSAGE, max_tokens=30, temperature=0.0, stream=True,
            extra_body={"kvlab": {"ignore_eos": True}},
        )
        chunks = iter(stream)
        next(chunks)
        server.terminate()
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length", "SIGTERM cut the running request short"
        assert server.process.wait(timeout=60) == 0, server.log.read_text(errors="replace")[-2000:]
        stored = [path for path in store.rglob("*") if path.is_file()]
        assert len(stored) >= 3, f"the prompt's 3 complete chunks were not all written before exit: {stored}"
    finally:
        server.stop()
