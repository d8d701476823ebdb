"""The HTTP layer in process (tiny random model): OpenAI shapes, SSE framing, errors, key, metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvlab.compress import compressors
from kvlab.engine import generate
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel
from kvlab.serve.app import create_app
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import ServeEngine
from tests.helpers import tiny_llama

PROMPT = "w5 w9 w17 w33 w40 w41 w60 w7 w8 w12 w13 w50 w51 w52 w70 w71"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny_llama()


def make_client(loaded: LoadedModel, **settings: object) -> TestClient:
    config = ServeConfig(**settings)  # type: ignore[arg-type]
    lossless = LosslessConfig(compressors.create("snapkv", budget=8), 3)
    engine = ServeEngine(loaded, config, lossless)
    # The address the server would be bound to: the app answers only its own Host names.
    return TestClient(create_app(engine, config, lossless), base_url=f"http://127.0.0.1:{config.port}")


@pytest.fixture(scope="module")
def client(loaded: LoadedModel) -> Iterator[TestClient]:
    with make_client(loaded, max_prompt_tokens=64) as client:
        yield client


def events(response_text: str) -> list[str]:
    assert response_text.endswith("data: [DONE]\n\n"), "a stream must end with [DONE]"
    return [block.removeprefix("data: ") for block in response_text.strip().split("\n\n")]


def test_a_completion_has_the_openai_shape_and_the_offline_text(client: TestClient, loaded: LoadedModel) -> None:
    reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                 "kvlab": {"mode": "lossless", "drafter_args": {"budget": 8}}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    prompt = loaded.encode_prompt(PROMPT, raw=True)
    expected = generate(loaded, [prompt], GenerationConfig(max_new_tokens=6)).requests[0]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["kvlab"]["mode"] == "lossless" and body["kvlab"]["rounds"] >= 1


def test_a_stream_is_server_sent_events_that_add_up_to_the_whole_reply(client: TestClient) -> None:
    request = {"prompt": PROMPT, "max_tokens": 7, "temperature": 0, "kvlab": {"ignore_eos": True}}
    whole = client.post("/v1/completions", json=request).json()
    streaming = {**request, "stream": True, "stream_options": {"include_usage": True}}
    streamed = client.post("/v1/completions", json=streaming)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = [json.loads(data) for data in events(streamed.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt": PROMPT, "best_of": 3}, 400, "best_of"),
        ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"prompt": " ".join([PROMPT] * 5)}, 400, "at most 64 (max_prompt_tokens)"),
        ({"prompt": [5, 6, 400]}, 400, "token ids must be in"),
        ({"prompt": PROMPT, "kvlab": {"mode": "lossless", "draft_length": 0}}, 400, "draft_length"),
        ({"prompt": PROMPT, "kvlab": {"mode": "lossy", "draft_length": 2}}, 400, "needs mode 'lossless'"),
        ({"prompt": PROMPT, "kvlab": {"cache_salt": "x" * 300}}, 400, "kvlab.cache_salt"),
        ({"messages": [{"role": "user", "content": "w5"}]}, 400, "prompt: Field required"),
    ],
)
def test_bad_requests_get_openai_error_objects(
    client: TestClient, body: dict[str, object], status: int, message: str
) -> None:
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == status, reply.text
    assert message in reply.json()["error"]["message"]


def test_chat_needs_a_chat_template(client: TestClient) -> None:
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w5"}]})
    assert reply.status_code == 400 and "no chat template" in reply.json()["error"]["message"]


def test_metrics_parse_with_prometheus_clients_parser(client: TestClient) -> None:
    lossless = {"mode": "lossless", "draft_length": 2}
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "kvlab": lossless})
    reply = client.get("/metrics")
    samples = {s.name: s.value for family in text_string_to_metric_families(reply.text) for s in family.samples}
    assert samples["kvlab:generation_tokens_total"] >= 3
    assert samples["kvlab:spec_decode_num_drafts_total"] >= 1
    assert samples["kvlab:num_requests_running"] == 0


def test_the_api_key_guards_the_v1_routes_only(loaded: LoadedModel) -> None:
    with make_client(loaded, api_key="k3y") as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k3y"}).json()["data"][0]["id"] == loaded.name
        assert client.get("/health").status_code == 200 and client.get("/").status_code == 200


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "[::1]:8000"])
def test_the_loopback_names_with_the_port_are_answered(client: TestClient, host: str) -> None:
    assert client.get("/health", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["attacker.example:8000", "127.0.0.1:8001", "localhost", "127.0.0.1:8000:1", "[::1"])
def test_other_host_names_are_refused(client: TestClient, host: str) -> None:
    reply = client.get("/health", headers={"Host": host})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_host", reply.text


def test_configured_hosts_replace_the_loopback_names(loaded: LoadedModel) -> None:
    with make_client(loaded, allowed_hosts=("kvlab.internal", "proxy:9000")) as client:
        assert client.get("/health", headers={"Host": "kvlab.internal:1234"}).status_code == 200
        assert client.get("/health", headers={"Host": "proxy:9000"}).status_code == 200
        assert client.get("/health", headers={"Host": "proxy:9001"}).status_code == 400
        assert client.get("/health", headers={"Host": "127.0.0.1:8000"}).status_code == 400


def test_a_foreign_origin_is_refused_and_the_servers_own_is_not(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1}
    foreign = client.post("/v1/completions", json=body, headers={"Origin": "http://attacker.example"})
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in foreign.headers
    own = client.post("/v1/completions", json=body, headers={"Origin": "http://127.0.0.1:8000"})
    assert own.status_code == 200, own.text
    assert "access-control-allow-origin" not in own.headers, "same-origin replies need no CORS headers"


def test_allowed_origins_get_cors_headers_and_preflight_answers(loaded: LoadedModel) -> None:
    with make_client(loaded, allowed_origins=("https://app.example",)) as client:
        preflight = client.options("/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        })
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in preflight.headers["access-control-allow-headers"]
        reply = client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "https://app.example"
        other = client.options("/v1/completions", headers={"Origin": "https://other.example",
                                                           "Access-Control-Request-Method": "POST"})
        assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/json; charset=latin-1", None])
def test_only_json_bodies_are_parsed(client: TestClient, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    reply = client.post("/v1/completions", content=json.dumps({"prompt": PROMPT, "max_tokens": 1}), headers=headers)
    assert reply.status_code == 415, reply.text


def test_json_with_a_utf8_charset_is_parsed(client: TestClient) -> None:
    reply = client.post("/v1/completions", content=json.dumps({"prompt": PROMPT, "max_tokens": 1}),
                        headers={"Content-Type": "application/json; charset=UTF-8"})
    assert reply.status_code == 200, reply.text


def test_the_tokens_of_finished_requests_are_given_back(loaded: LoadedModel) -> None:
    with make_client(loaded, max_tokens_in_system=40, max_tokens_per_request=40) as client:
        for _ in range(3):  # each holds 16 + 20 of the 40 tokens while it runs
            reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 20})
            assert reply.status_code == 200, reply.text
        too_many = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 30})
        assert too_many.status_code == 400 and "max_tokens_in_system" in too_many.json()["error"]["message"]
        families = text_string_to_metric_families(client.get("/metrics").text)
        samples = {sample.name: sample.value for family in families for sample in family.samples}
        assert samples["kvlab:num_tokens_in_system"] == 0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"a": ' + b"[" * 31 + b"]" * 31 + b"}", None),  # 32 levels, the body's object included
        (b'{"a": ' + b"[" * 32 + b"]" * 32 + b"}", "deeper than 32 levels"),
        (b'{"a": "' + b"[{" * 5000 + b'\\" ]}"}', None),  # brackets and escaped quotes inside a string
        (b'{"a": ' + b"[" * 100_000, "deeper than 32 levels"),
        (b"{not json", "not valid JSON"),
        (b'{"a": {"b": [0, ' + b"1" * 21 + b"]}}", "a.b.1: integers are limited to 20 digits"),
        (b'{"a": -' + b"1" * 20 + b"}", None),
        (b'{"a": [' + b"0," * (1 << 20) + b"0]}", "more than 1048576 JSON values"),
    ],
)
def test_the_parser_bounds_depth_values_and_numbers(raw: bytes, message: str | None) -> None:
    from kvlab.serve.body import BodyError, parse_body

    if message is None:
        assert isinstance(parse_body(raw), dict)
        return
    with pytest.raises(BodyError, match=message):
        parse_body(raw)


def test_rounds_that_draft_nothing_are_not_counted_as_drafts(client: TestClient) -> None:
    def drafts() -> tuple[float, float]:
        text = client.get("/metrics").text
        samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
        return samples["kvlab:spec_decode_num_drafts_total"], samples["kvlab:spec_decode_num_draft_tokens_total"]

    before = drafts()
    # The prefill gives the first token; the one left is a round with nothing to draft (vLLM counts none).
    # Greedy: the default temperature (1) samples, and a sampled end-of-sequence token would end it at one.
    reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                 "kvlab": {"mode": "lossless"}})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    assert drafts() == before


def test_metrics_report_the_planners_cost_model_fit(client: TestClient) -> None:
    reply = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                 "kvlab": {"mode": "lossless", "ignore_eos": True}})
    assert reply.status_code == 200
    text = client.get("/metrics").text
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["kvlab:cost_model_ticks"] > 0, "a lossless request's ticks were not predicted"
    assert 0.0 <= samples["kvlab:cost_model_mean_relative_error"] < 10.0
