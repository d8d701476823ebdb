"""guidellm 0.8.1 (.venv-guidellm) against `kvlab serve`: a synchronous streamed benchmark of synthetic
prompts with a bounded request count, on text completions and on chat. guidellm exits 0 even when every
request fails, so the test reads its JSON report: every request succeeded with the output length asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_clients.clients import run_client, server_log
from tests.integration.test_serve.server import ServeProcess

NUM_REQUESTS = 4
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
TIMEOUT_S = 300
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def guidellm(venv: Path, workdir: Path, server: ServeProcess, model_dir: str, endpoint: str) -> dict[str, Any]:
    """`guidellm run`, synchronous, NUM_REQUESTS streamed requests; the report it writes as JSON."""
    label = endpoint.strip("/").replace("/", "-")
    report = workdir / f"{label}.json"
    backend = {"kind": "openai_http", "target": server.url, "request_format": endpoint, "stream": True}
    command = [
        str(venv / "bin" / "guidellm"), "run", "--backend", json.dumps(backend), "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=hf_auto,model={model_dir}", "--output", f"kind=json,path={report}",
        "--disable-progress",
    ]  # fmt: skip
    run_client(command, workdir, f"guidellm-{label}.log", TIMEOUT_S)
    return dict(json.loads(report.read_text()))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("guidellm")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_guidellm_synchronous_benchmark_succeeds(
    guidellm_venv: Path, workdir: Path, server: ServeProcess, model_dir: str, endpoint: str
) -> None:
    report = guidellm(guidellm_venv, workdir, server, model_dir, ENDPOINTS[endpoint])
    (benchmark,) = report["benchmarks"]
    requests = benchmark["requests"]
    errors = [request["info"]["error"] for request in requests["errored"]]
    assert not errors, f"{len(errors)} failed requests, e.g. {errors[0]}; server log: {server_log(server)}"
    assert not requests["incomplete"], f"{len(requests['incomplete'])} incomplete requests"
    assert len(requests["successful"]) == NUM_REQUESTS, f"{len(requests['successful'])} of {NUM_REQUESTS} succeeded"
    output_tokens = [request["output_metrics"]["text_tokens"] for request in requests["successful"]]
    assert output_tokens == [OUTPUT_TOKENS] * NUM_REQUESTS, f"output tokens per request: {output_tokens}"
