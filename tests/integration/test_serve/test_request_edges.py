"""The request-validation edges of issue 33, each sent to a real `kvlab serve` process on loopback:
strings that are not text, a failure inside a route (whole and streamed), lax types, chat parts past
their bounds, `min_tokens` past what can be generated, `/tokenize` past the prompt limit, and draft
weights per request."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kvlab.serve.protocol import MAX_CHAT_MESSAGES, MAX_CHAT_PARTS, MAX_MESSAGE_PARTS
from tests.integration.test_serve.server import ServeProcess
from tests.integration.test_serve.test_api import PASSAGE

pytestmark = pytest.mark.integration

MAX_PROMPT_TOKENS = 256
LONE = "\ud800"  # json.dumps sends it as the escape \ud800, as the attack did
# A request with this seed fails inside the route (see FAULTS): how a bug in the server would.
FAULT_SEED = 4242424242
FAULTS = f'''"""Fault injection for test_request_edges: a reply to a request seeded {FAULT_SEED} fails."""
from kvlab.threads import configure_wait_policy

configure_wait_policy()  # before torch loads, as kvlab.cli does

from kvlab.serve.choices import ChoiceReply  # noqa: E402


def _failing(method):
    def wrapper(self, *args, **kwargs):
        if self.request.config.seed == {FAULT_SEED}:
            raise RuntimeError("an injected fault in /a/private/path")
        return method(self, *args, **kwargs)
    return wrapper


for _name in ("whole", "on_tokens", "on_finished"):
    setattr(ChoiceReply, _name, _failing(getattr(ChoiceReply, _name)))
'''
LOSSLESS = {"mode": "lossless", "drafter": "snapkv", "drafter_args": {"compression_ratio": 0.5, "window_size": 8},
            "draft_length": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The embedded model, short prompts, bf16 draft weights allowed, and the fault injected."""
    workdir = tmp_path_factory.mktemp("edges")
    faults = workdir / "faults"
    faults.mkdir()
    (faults / "sitecustomize.py").write_text(FAULTS)
    python_path = os.pathsep.join(part for part in (str(faults), os.environ.get("PYTHONPATH")) if part)
    process = ServeProcess(workdir, "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--allowed-draft-weights", "bf16",
                           "--max-num-seqs", "4", env={"PYTHONPATH": python_path})
    yield process
    process.stop()


def post(server: ServeProcess, path: str, body: bytes | dict[str, Any]) -> tuple[int, str, str]:
    """Status, Content-Type and text of the answer (whatever its type: a bare 500 must fail the test)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers.get("content-type", ""), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("content-type", ""), error.read().decode()


def refused(server: ServeProcess, path: str, body: bytes | dict[str, Any], status: int = 400) -> dict[str, Any]:
    """The error object of a refused request, after checking it is one."""
    code, content_type, text = post(server, path, body)
    assert code == status and content_type == "application/json", f"{path}: {code} {content_type}: {text[:300]}"
    error: dict[str, Any] = json.loads(text)["error"]
    return error


def num_tracebacks(server: ServeProcess) -> int:
    return server.log.read_text(errors="replace").count("Traceback (most recent call last)")


def wait_for_tracebacks(server: ServeProcess, expected: int) -> int:
    """The log's tracebacks once there are `expected` (uvicorn logs after it has answered), or after 30 s."""
    deadline = time.monotonic() + 30
    while num_tracebacks(server) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return num_tracebacks(server)


def chat_body(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2}


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def works(server: ServeProcess) -> None:
    status, body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, f"the server stopped serving: {body}"


# ----- 1. a lone surrogate


@pytest.mark.parametrize(
    ("path", "body", "where"),
    [
        ("/v1/completions", {"prompt": "Hello " + LONE, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["Hello", LONE], "max_tokens": 2}, "prompt.1"),
        ("/v1/completions", {"prompt": "Hello", "stop": LONE}, "stop"),
        ("/v1/completions", {"prompt": "Hello", "stop": ["world", "\udc00"]}, "stop.1"),
        ("/v1/chat/completions", chat_body(LONE), "messages.0.content"),
        ("/v1/chat/completions", chat_body([text_part("Hi"), text_part(LONE)]), "messages.0.content.1.text"),
        ("/tokenize", {"prompt": LONE}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": [text_part(LONE)]}]}, "messages.0.content.0.text"),
        ("/detokenize", {"tokens": [1], "model": LONE}, "model"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field_and_logs_no_traceback(
    server: ServeProcess, path: str, body: dict[str, Any], where: str
) -> None:
    before = num_tracebacks(server)
    error = refused(server, path, body)
    assert error["type"] == "invalid_request_error", error
    assert error["message"].startswith(f"{where}: holds a lone UTF-16 surrogate"), error
    works(server)
    assert num_tracebacks(server) == before, "a refused request logged a traceback"


def test_a_surrogate_encoded_as_utf8_bytes_is_a_400(server: ServeProcess) -> None:
    error = refused(server, "/v1/completions", b'{"prompt": "Hello \xed\xa0\x80", "max_tokens": 2}')
    assert "not UTF-8" in error["message"], error


def test_an_escaped_surrogate_pair_is_text(server: ServeProcess) -> None:
    status, body = server.post("/tokenize", {"prompt": "Hello \U0001f600", "add_special_tokens": False})
    assert status == 200 and body["count"] >= 2, body


# ----- 2. a failure inside a route


def test_a_failure_inside_a_route_is_an_openai_error_object_logged_once(server: ServeProcess) -> None:
    before = num_tracebacks(server)
    error = refused(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "seed": FAULT_SEED}, status=500)
    assert error["type"] == "internal_error" and "RuntimeError" in error["message"], error
    assert "/a/private/path" not in error["message"] and "Traceback" not in error["message"], error
    assert wait_for_tracebacks(server, before + 1) == before + 1, "the failure was not logged exactly once"
    works(server)


def test_a_stream_that_fails_ends_with_an_error_event_and_done(server: ServeProcess) -> None:
    before = num_tracebacks(server)
    body = {"prompt": "Hello", "max_tokens": 8, "seed": FAULT_SEED, "stream": True, "kvlab": {"ignore_eos": True}}
    status, content_type, text = post(server, "/v1/completions", body)
    assert status == 200 and content_type.startswith("text/event-stream"), f"{status} {content_type}: {text[:300]}"
    assert text.endswith("data: [DONE]\n\n"), f"the stream was cut: {text[-300:]!r}"
    events = [block.removeprefix("data: ") for block in text.strip().split("\n\n")]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "internal_error" and "/a/private/path" not in text, error
    assert wait_for_tracebacks(server, before + 1) == before + 1, "the failure was not logged exactly once"
    deadline = time.monotonic() + 30
    while server.metric("kvlab:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("kvlab:num_requests_running") == 0, "the failed stream's request still runs"
    works(server)


# ----- 3. strict types


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"kvlab": {**LOSSLESS, "draft_length": True}}, "kvlab.draft_length"),
        ({"kvlab": {**LOSSLESS, "draft_length": 2.0}}, "kvlab.draft_length"),
        ({"kvlab": {**LOSSLESS, "drafter": ""}}, "kvlab.drafter"),
        ({"kvlab": {"ignore_eos": 1}}, "kvlab.ignore_eos"),
        ({"temperature": True}, "temperature"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"stream": "true"}, "stream"),
        ({"seed": 7.0}, "seed"),
        ({"model": ""}, "model"),
    ],
)
def test_lax_types_and_empty_names_are_a_400_naming_the_field(server: ServeProcess, body: dict[str, Any],
                                                              where: str) -> None:
    error = refused(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, **body})
    assert error["message"].startswith(f"{where}: "), error


def test_an_integer_temperature_is_a_number(server: ServeProcess) -> None:
    status, body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 1, "seed": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


# ----- 4. chat parts and messages


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (chat_body([text_part("")] * 300_000), f"messages: at most {MAX_CHAT_PARTS} text parts in all the messages"),
        (chat_body([text_part("")] * (MAX_MESSAGE_PARTS + 1)),
         f"messages.0.content: at most {MAX_MESSAGE_PARTS} text parts per message"),
        ({"messages": [{"role": "user", "content": "Hi"}] * (MAX_CHAT_MESSAGES + 1)},
         f"at most {MAX_CHAT_MESSAGES} items"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_chat_parts_and_messages_past_their_bounds_are_a_400(server: ServeProcess, path: str, body: dict[str, Any],
                                                              message: str) -> None:
    if path == "/tokenize":
        body = {"messages": body["messages"]}
    error = refused(server, path, body)
    assert message in error["message"], error


# ----- 5. min_tokens past what can be generated


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "min_tokens": 4},
         "min_tokens=4 is more than max_tokens=3"),
        ("/v1/completions", {"prompt": "Hello", "min_tokens": 17},
         "min_tokens=17 is more than the 16 tokens this request may generate without max_tokens"),
        ("/v1/chat/completions", {**chat_body("Hi"), "max_tokens": None, "max_completion_tokens": 3, "min_tokens": 4},
         "min_tokens=4 is more than max_completion_tokens=3"),
    ],
)
def test_min_tokens_past_max_tokens_is_a_400_naming_both(server: ServeProcess, path: str, body: dict[str, Any],
                                                         message: str) -> None:
    error = refused(server, path, body)
    assert message in error["message"], error


def test_min_tokens_equal_to_max_tokens_generates_exactly_that_many(server: ServeProcess) -> None:
    status, body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4, "min_tokens": 4,
                                                   "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body


# ----- 6. /tokenize past the prompt limit


@pytest.mark.parametrize("chat", [False, True], ids=["prompt", "messages"])
def test_tokenize_past_the_prompt_limit_is_a_400(server: ServeProcess, chat: bool) -> None:
    text = " a" * (2 * MAX_PROMPT_TOKENS)  # well within the characters allowed, past the tokens
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    error = refused(server, "/tokenize", body)
    assert f"this server accepts at most {MAX_PROMPT_TOKENS}" in error["message"], error
    status, counted = server.post("/tokenize", {"prompt": " a" * (MAX_PROMPT_TOKENS // 2)})
    assert status == 200 and counted["count"] <= MAX_PROMPT_TOKENS, counted


# ----- 7. draft weights per request


def test_a_request_may_draft_with_allowed_weights_and_its_text_stays_plains(server: ServeProcess) -> None:
    body = {"prompt": PASSAGE, "max_tokens": 12, "temperature": 0}
    status, plain = server.post("/v1/completions", body)
    assert status == 200, plain
    status, drafted = server.post("/v1/completions", {**body, "kvlab": {**LOSSLESS, "draft_weights": "bf16"}})
    assert status == 200 and drafted["kvlab"]["mode"] == "lossless", drafted
    assert drafted["choices"][0]["text"] == plain["choices"][0]["text"], "bf16 drafting changed the greedy text"


@pytest.mark.parametrize(
    ("kvlab", "message"),
    [
        ({**LOSSLESS, "draft_weights": "int8"}, "kvlab.draft_weights='int8' is not allowed on this server, which "
                                               "drafts with same, bf16"),
        ({**LOSSLESS, "draft_weights": "fp8"}, "kvlab.draft_weights: "),
        ({"mode": "plain", "draft_weights": "bf16"}, "kvlab.draft_weights needs mode 'lossless'"),
    ],
)
def test_draft_weights_the_server_does_not_allow_are_a_400(server: ServeProcess, kvlab: dict[str, Any],
                                                           message: str) -> None:
    error = refused(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "kvlab": kvlab})
    assert message in error["message"], error
