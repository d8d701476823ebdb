"""Request validation at its edges (issue 33): strings that are not text, strict types, bounded chat
parts, `min_tokens` past what can be generated, `/tokenize` past the prompt limit, per-request draft
weights, and the catch-all that turns an unexpected failure into an OpenAI error object."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from kvlab.compress import compressors
from kvlab.errors import ConfigError
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel, wrap_model
from kvlab.serve import options, protocol
from kvlab.serve.app import create_app
from kvlab.serve.body import BodyError, parse_body
from kvlab.serve.choices import ChoiceReply
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import ServeEngine
from kvlab.serve.protocol import (
    MAX_CHAT_MESSAGES,
    MAX_CHAT_PARTS,
    MAX_MESSAGE_PARTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.helpers import tiny_llama, tiny_tokenizer

PROMPT = "w5 w9 w17 w33 w40 w41 w60 w7"
LOSSLESS = {"mode": "lossless", "drafter_args": {"budget": 4}}
LONE = "\ud800"  # json.dumps escapes it as \ud800, as an attacker sends it


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny_llama()


def validate(model: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    """What the server does with a body: parse within the bounds, then validate."""
    return model.model_validate(parse_body(json.dumps(body).encode()))


def refusal(model: type[BaseModel], body: dict[str, Any]) -> str:
    """The 400's message, as `kvlab.serve.app` words it (`where: message`)."""
    try:
        validate(model, body)
    except BodyError as error:
        return str(error)
    except ValidationError as error:
        first = error.errors()[0]
        return f"{'.'.join(str(part) for part in first['loc'])}: {first['msg'].removeprefix('Value error, ')}"
    raise AssertionError(f"{model.__name__} accepted {body!r}")


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


# ----- strings that are not text


@pytest.mark.parametrize(
    ("model", "body", "where"),
    [
        (CompletionRequest, {"prompt": LONE}, "prompt"),
        (CompletionRequest, {"prompt": ["w5", "w6" + LONE]}, "prompt.1"),
        (CompletionRequest, {"prompt": PROMPT, "stop": LONE}, "stop"),
        (CompletionRequest, {"prompt": PROMPT, "stop": ["w5", LONE]}, "stop.1"),
        (CompletionRequest, {"prompt": PROMPT, "kvlab": {"drafter": "snapkv" + LONE}}, "kvlab.drafter"),
        (CompletionRequest, {"prompt": PROMPT, "user": "\udfff"}, "user"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [text_part("w5"), text_part(LONE)]}]},
         "messages.0.content.1.text"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "w5", "name": LONE}]}, "messages.0.name"),
        (TokenizeRequest, {"prompt": "w5 " + LONE}, "prompt"),
        (TokenizeRequest, {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
        (CompletionRequest, {"prompt": PROMPT, "kvlab": {LONE: 1}}, "kvlab.\\ud800"),
    ],
)
def test_a_lone_surrogate_anywhere_is_refused_naming_where(model: type[BaseModel], body: dict[str, Any],
                                                          where: str) -> None:
    message = refusal(model, body)
    assert message.startswith(f"{where}: holds a lone UTF-16 surrogate"), message
    message.encode("utf-8")  # the message itself must be text the reply can carry


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "w5 \\ud83d\\ude00"}',  # an escaped pair: one character past U+FFFF
        '{"prompt": "w5 \U0001f600"}'.encode(),
        b'{"prompt": "w5 \\\\ud800"}',  # an escaped backslash, then the letters: text
        b'\xef\xbb\xbf{"prompt": "w5"}',  # a UTF-8 byte-order mark
    ],
)
def test_text_past_the_basic_plane_and_escaped_backslashes_are_accepted(raw: bytes) -> None:
    body = parse_body(raw)
    body["prompt"].encode("utf-8")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"prompt": "w5 \xed\xa0\x80"}', "not UTF-8"),  # a surrogate encoded as UTF-8 bytes
        ('{"prompt": "w5"}'.encode("utf-16"), "not UTF-8"),
        (b'{"prompt": "w5", "stop": ["\\udc00\\ud800"]}', "stop.0: holds a lone"),  # a pair in the wrong order
    ],
)
def test_bodies_that_are_not_utf8_text_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message):
        parse_body(raw)


# ----- strict types


REQUEST_MODELS = [
    member for _, member in inspect.getmembers(protocol, inspect.isclass)
    if issubclass(member, BaseModel) and member.__module__ == protocol.__name__
]


def test_every_request_model_is_covered() -> None:
    names = {model.__name__ for model in REQUEST_MODELS}
    expected = {"_Common", "CompletionRequest", "ChatCompletionRequest", "KvlabOptions", "StreamOptions", "TextPart",
                "ChatMessage", "TokenizeRequest", "DetokenizeRequest"}
    assert names == expected, f"request models changed: {sorted(names ^ expected)} (cover them here)"


@pytest.mark.parametrize("model", REQUEST_MODELS, ids=lambda model: model.__name__)
def test_every_request_model_is_strict_and_refuses_unknown_fields(model: type[BaseModel]) -> None:
    config = model.model_config
    assert config.get("strict") is True and config.get("extra") == "forbid", f"{model.__name__} is lax: {config}"


@pytest.mark.parametrize(
    ("model", "body", "where"),
    [
        (CompletionRequest, {"kvlab": {"draft_length": True}}, "kvlab.draft_length"),
        (CompletionRequest, {"kvlab": {"draft_length": 2.0}}, "kvlab.draft_length"),
        (CompletionRequest, {"kvlab": {"draft_length": "3"}}, "kvlab.draft_length"),
        (CompletionRequest, {"kvlab": {"ignore_eos": 1}}, "kvlab.ignore_eos"),
        (CompletionRequest, {"kvlab": {"mode": 1}}, "kvlab.mode"),
        (CompletionRequest, {"kvlab": {"draft_weights": "fp8"}}, "kvlab.draft_weights"),
        (CompletionRequest, {"max_tokens": 2.0}, "max_tokens"),
        (CompletionRequest, {"max_tokens": True}, "max_tokens"),
        (CompletionRequest, {"temperature": True}, "temperature"),
        (CompletionRequest, {"temperature": "0"}, "temperature"),
        (CompletionRequest, {"top_p": False}, "top_p"),
        (CompletionRequest, {"seed": 1.0}, "seed"),
        (CompletionRequest, {"n": True}, "n"),
        (CompletionRequest, {"stream": 1}, "stream"),
        (CompletionRequest, {"echo": "true"}, "echo"),
        (CompletionRequest, {"logprobs": True}, "logprobs"),
        (CompletionRequest, {"min_tokens": False}, "min_tokens"),
        (CompletionRequest, {"stop_token_ids": [True]}, "stop_token_ids.0"),
        (CompletionRequest, {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        (ChatCompletionRequest, {"logprobs": 1}, "logprobs"),
        (ChatCompletionRequest, {"max_completion_tokens": 4.0}, "max_completion_tokens"),
        (TokenizeRequest, {"add_special_tokens": 0}, "add_special_tokens"),
        (DetokenizeRequest, {"tokens": [5, 6.0]}, "tokens.1"),
    ],
)
def test_booleans_numbers_and_strings_are_not_converted(model: type[BaseModel], body: dict[str, Any],
                                                         where: str) -> None:
    message = refusal(model, {**base_body(model), **body})
    assert message.startswith(f"{where}"), message


def base_body(model: type[BaseModel]) -> dict[str, Any]:
    if model is ChatCompletionRequest:
        return {"messages": [{"role": "user", "content": "w5"}]}
    if model is DetokenizeRequest:
        return {"tokens": [5]}
    return {"prompt": PROMPT}


@pytest.mark.parametrize(
    ("model", "body", "where"),
    [
        (CompletionRequest, {"model": ""}, "model"),
        (CompletionRequest, {"kvlab": {"drafter": ""}}, "kvlab.drafter"),
        (CompletionRequest, {"kvlab": {"cache_salt": ""}}, "kvlab.cache_salt"),
        (CompletionRequest, {"kvlab": {"drafter_args": {"": 1}}}, "kvlab.drafter_args: a parameter name is empty"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "w5", "name": ""}]}, "messages.0.name"),
        (TokenizeRequest, {"model": ""}, "model"),
        (DetokenizeRequest, {"model": ""}, "model"),
    ],
)
def test_empty_names_are_refused(model: type[BaseModel], body: dict[str, Any], where: str) -> None:
    message = refusal(model, {**base_body(model), **body})
    assert message.startswith(where), message


def test_json_numbers_without_a_fraction_are_floats_where_openai_takes_floats() -> None:
    request = validate(CompletionRequest, {"prompt": PROMPT, "temperature": 1, "top_p": 1})
    assert isinstance(request, CompletionRequest)
    assert (request.temperature, request.top_p) == (1.0, 1.0)
    assert isinstance(request.temperature, float), "temperature: 1 must be taken as the float 1.0"


def test_drafter_args_keep_each_values_own_type() -> None:
    request = validate(CompletionRequest, {"prompt": PROMPT, "kvlab": {"drafter_args": {"a": True, "b": 1, "c": 1.0}}})
    assert isinstance(request, CompletionRequest)
    args = request.kvlab.drafter_args or {}
    assert [type(args[name]) for name in "abc"] == [bool, int, float], f"drafter_args converted: {args}"


# ----- chat parts and messages


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": [text_part("")] * 300_000}], f"messages: at most {MAX_CHAT_PARTS}"),
        ([{"role": "user", "content": [text_part("")] * (MAX_MESSAGE_PARTS + 1)}],
         f"messages.0.content: at most {MAX_MESSAGE_PARTS} text parts per message"),
        ([{"role": "user", "content": [text_part("")] * MAX_MESSAGE_PARTS}] * (MAX_CHAT_PARTS // MAX_MESSAGE_PARTS + 1),
         f"at most {MAX_CHAT_PARTS} text parts in all the messages"),
        ([{"role": "user", "content": "w5"}] * (MAX_CHAT_MESSAGES + 1), f"at most {MAX_CHAT_MESSAGES} items"),
    ],
)
@pytest.mark.parametrize("model", [ChatCompletionRequest, TokenizeRequest])
def test_parts_and_messages_are_bounded(model: type[BaseModel], messages: list[dict[str, Any]], message: str) -> None:
    assert message in refusal(model, {"messages": messages})


def test_parts_up_to_the_bounds_are_accepted() -> None:
    message = {"role": "user", "content": [text_part("w5")] * MAX_MESSAGE_PARTS}
    messages = [message] * (MAX_CHAT_PARTS // MAX_MESSAGE_PARTS)
    request = validate(ChatCompletionRequest, {"messages": messages})
    assert isinstance(request, ChatCompletionRequest) and request.messages[0].text == "w5" * MAX_MESSAGE_PARTS


@pytest.mark.parametrize("num_parts", [MAX_MESSAGE_PARTS + 1, MAX_CHAT_PARTS + 1])
def test_parts_past_the_bounds_are_refused_before_any_is_validated(num_parts: int) -> None:
    # The first part is malformed: had the parts been validated first, it would be the error.
    parts = [{"type": "image_url"}] + [text_part("")] * (num_parts - 1)
    message = refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": parts}]})
    assert "text parts" in message, f"the parts were validated before they were counted: {message}"


# ----- min_tokens, /tokenize, draft weights (options)


def resolve(body: dict[str, Any], loaded: LoadedModel, **settings: Any) -> options.ResolvedBody:
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    request = validate(model, body)
    assert isinstance(request, (CompletionRequest, ChatCompletionRequest))
    serve = ServeConfig(**settings)
    default = LosslessConfig(compressors.create("snapkv", budget=4), 3, draft_weights=serve.draft_weights)
    return options.resolve(request, loaded, serve, default)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 3, "min_tokens": 4}, "min_tokens=4 is more than max_tokens=3"),
        ({"min_tokens": 17}, "min_tokens=17 is more than the 16 tokens this request may generate without max_tokens"),
        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens=1 is more than max_tokens=0"),
    ],
)
def test_min_tokens_past_what_can_be_generated_is_refused(loaded: LoadedModel, body: dict[str, Any],
                                                          message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve({"prompt": PROMPT, **body}, loaded)


def test_min_tokens_past_the_context_left_is_refused_when_max_tokens_is_not_given(loaded: LoadedModel) -> None:
    prompt = [5] * (loaded.architecture.max_context - 10)
    with pytest.raises(ConfigError, match="min_tokens=11 is more than the 10 tokens"):
        resolve({"prompt": prompt, "min_tokens": 11, "max_tokens": None}, loaded, max_tokens_limit=64)
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "w5"}], "min_tokens": 5, "max_completion_tokens": 4}
    )
    with pytest.raises(ConfigError, match="min_tokens=5 is more than max_completion_tokens=4"):
        options.generation_config(chat, 8, loaded.architecture.max_context, ServeConfig())


@pytest.mark.parametrize(("body", "min_tokens"), [({"max_tokens": 4, "min_tokens": 4}, 4), ({"min_tokens": 16}, 16)])
def test_min_tokens_up_to_what_can_be_generated_is_kept(loaded: LoadedModel, body: dict[str, Any],
                                                         min_tokens: int) -> None:
    config = resolve({"prompt": PROMPT, **body}, loaded).requests[0].config
    assert config.min_tokens == min_tokens <= config.max_new_tokens


def test_tokenize_refuses_more_tokens_than_the_prompt_limit(loaded: LoadedModel) -> None:
    limit = 8
    exact = TokenizeRequest.model_validate({"prompt": " ".join(["w5"] * limit), "add_special_tokens": False})
    assert options.tokenize(exact, loaded, limit) == [5] * limit
    # Each word is one token: well within the characters allowed, past the tokens.
    over = TokenizeRequest.model_validate({"prompt": " ".join(["w5"] * (limit + 1)), "add_special_tokens": False})
    with pytest.raises(ConfigError, match=f"the text has {limit + 1} tokens; this server accepts at most {limit}"):
        options.tokenize(over, loaded, limit)


def test_a_request_drafts_with_the_weights_it_names_among_those_allowed(loaded: LoadedModel) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "kvlab": {**LOSSLESS, "draft_weights": "bf16"}}
    request = resolve(body, loaded, allowed_draft_weights=("bf16",)).requests[0]
    assert request.lossless is not None and request.lossless.draft_weights == "bf16"
    default = resolve({**body, "kvlab": LOSSLESS}, loaded, draft_weights="int8").requests[0]
    assert default.lossless is not None and default.lossless.draft_weights == "int8", "the server's default is lost"


@pytest.mark.parametrize(
    ("kvlab", "settings", "message"),
    [
        ({**LOSSLESS, "draft_weights": "int8"}, {}, r"kvlab.draft_weights='int8' is not allowed .* same \("),
        ({**LOSSLESS, "draft_weights": "int8"}, {"allowed_draft_weights": ("bf16",)}, "with same, bf16 "),
        ({"mode": "plain", "draft_weights": "same"}, {}, "kvlab.draft_weights needs mode 'lossless'"),
        ({**LOSSLESS, "mode": "lossy", "draft_weights": "bf16"}, {"allowed_draft_weights": ("bf16",)},
         "needs mode 'lossless'"),
    ],
)
def test_draft_weights_the_server_does_not_allow_are_refused_listing_those_it_does(
    loaded: LoadedModel, kvlab: dict[str, Any], settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve({"prompt": PROMPT, "max_tokens": 2, "kvlab": kvlab}, loaded, **settings)


def test_the_allowed_draft_weights_are_built_at_start_up(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    monkeypatch.setattr(options, "draft_model", lambda model, weights: built.append((model, weights)))
    options.build_draft_weights(loaded, ServeConfig(draft_weights="bf16", allowed_draft_weights=("same", "bf16")))
    assert built == [(loaded.model, "bf16"), (loaded.model, "same")], f"built {built}"


def test_with_compile_forward_the_served_and_draft_graphs_compile_at_start_up() -> None:
    served = wrap_model(tiny_llama(num_kv_heads=2, seed=3, packed_weights=False).model, tiny_tokenizer(),
                        compile_forward=True)
    config = ServeConfig(draft_weights="bf16", allowed_draft_weights=("same", "int8"))
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert options.compile_forwards_now(served, config) == 2  # the served model and its bf16 copy; int8 runs eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before + 2
    assert options.compile_forwards_now(tiny_llama(num_kv_heads=2), config) == 0  # packed: nothing compiled


def test_allowed_draft_weights_must_be_known() -> None:
    with pytest.raises(ConfigError, match="allowed draft weights must be among same, bf16, int8, int4, got 'fp8'"):
        ServeConfig(allowed_draft_weights=("fp8",))


# ----- the catch-all


@pytest.fixture(scope="module")
def client(loaded: LoadedModel) -> Iterator[TestClient]:
    config = ServeConfig()
    lossless = LosslessConfig(compressors.create("snapkv", budget=8), 3)
    engine = ServeEngine(loaded, config, lossless)
    # raise_server_exceptions=False: the client sees what a real server sends once the app re-raises.
    app = create_app(engine, config, lossless)
    with TestClient(app, base_url=f"http://127.0.0.1:{config.port}", raise_server_exceptions=False) as client:
        yield client


def failing(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("an injected fault in /a/private/path")


def test_an_unexpected_failure_in_a_route_is_an_openai_error_object(client: TestClient,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ChoiceReply, "whole", failing)
    reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert reply.status_code == 500 and reply.headers["content-type"] == "application/json", reply.text
    error = reply.json()["error"]
    assert error["type"] == "internal_error" and "RuntimeError" in error["message"], error
    assert "/a/private/path" not in reply.text and "Traceback" not in reply.text, "the reply shows the traceback"


def test_a_stream_that_fails_once_started_ends_with_an_error_event_and_done(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ChoiceReply, "on_tokens", failing)
    monkeypatch.setattr(ChoiceReply, "on_finished", failing)
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "kvlab": {"ignore_eos": True}}
    with caplog.at_level("ERROR", logger="kvlab.serve.app"):
        reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n"), reply.text
    events = [block.removeprefix("data: ") for block in reply.text.strip().split("\n\n")]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "internal_error" and "/a/private/path" not in reply.text, reply.text
    failures = [record for record in caplog.records if record.exc_info is not None]
    assert len(failures) == 1, f"the failure was logged {len(failures)} times with its traceback"
    monkeypatch.undo()
    after = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert after.status_code == 200, f"the server did not recover: {after.text}"
