"""`vllm bench serve` (vLLM 0.32's CPU build, .venv-vllm) against `kvlab serve` with its random data set:
completions and chat, plain and lossless. Every request succeeds with the output length asked for
(ignore_eos), vLLM's client-side TTFT agrees with the server's own, and with `--metrics-prefix vllm` its
speculative-decoding section reports the server's drafts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_clients.clients import histogram, run_client, server_log
from tests.integration.test_serve.server import ServeProcess

NUM_PROMPTS = 8
INPUT_LEN = 32
OUTPUT_LEN = 16
# The client's TTFT adds only the HTTP round trip on loopback to the server's (arrival to first token).
TTFT_RTOL = 0.2
TIMEOUT_S = 300
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# A fixed draft length: under `auto` a sequence may stand aside (draft nothing) on a loaded machine, and a
# request that drafted nothing adds no draft to the counters this test reads.
MODES = {"plain": None, "lossless": {"kvlab": {"mode": "lossless", "draft_length": 4}}}
DRAFTS = "kvlab:spec_decode_num_drafts_total"
TTFT = "kvlab:time_to_first_token_seconds"
# vllm bench's result fields -> the server's counters it reads them from (vllm:spec_decode_<name>_total).
SPEC_DECODE_FIELDS = {
    "spec_decode_num_drafts": "num_drafts",
    "spec_decode_draft_tokens": "num_draft_tokens",
    "spec_decode_accepted_tokens": "num_accepted_tokens",
}


def vllm_bench(
    venv: Path, workdir: Path, server: ServeProcess, model_dir: str, backend: str, extra_body: dict[str, Any] | None
) -> dict[str, Any]:
    """One `vllm bench serve` run (all prompts at once), its saved result with per-request details."""
    label = f"{backend}-{'extra' if extra_body else 'plain'}-{server.port}"
    command = [
        str(venv / "bin" / "vllm"), "bench", "serve", "--backend", backend, "--base-url", server.url,
        "--endpoint", BACKENDS[backend], "--model", "smollm2", "--tokenizer", model_dir,
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(NUM_PROMPTS), "--ignore-eos", "--seed", "0", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(workdir), "--result-filename", f"{label}.json",
    ]  # fmt: skip
    if extra_body is not None:
        command += ["--extra-body", json.dumps(extra_body)]
    run_client(command, workdir, f"vllm-bench-{label}.log", TIMEOUT_S)
    return dict(json.loads((workdir / f"{label}.json").read_text()))


def assert_every_request_succeeded(result: dict[str, Any], server: ServeProcess) -> None:
    assert result["failed"] == 0 and result["completed"] == NUM_PROMPTS, (
        f"{result['completed']} of {NUM_PROMPTS} requests completed; errors: {result['errors'][:3]}; "
        f"server log: {server_log(server)}"
    )
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS, f"output tokens per request: {result['output_lens']}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-bench")


@pytest.fixture(scope="module")
def vllm_named_lossless_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """Lossless for every request (server-wide), with the counters also under vLLM's names. A fixed draft
    length: under `auto` a sequence may stand aside (draft nothing) whenever drafting does not pay on a
    loaded machine, and this test is about the counters, not that choice."""
    workdir = tmp_path_factory.mktemp("clients-serve-vllm-names")
    process = ServeProcess(workdir, "--lossless", "--num-draft-tokens", "4", "--metrics-prefix", "vllm")
    yield process
    process.stop()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_bench_serve_random(
    vllm_venv: Path, workdir: Path, server: ServeProcess, model_dir: str, backend: str, mode: str
) -> None:
    ttft_before, drafts_before = histogram(server, TTFT), server.metric(DRAFTS)
    result = vllm_bench(vllm_venv, workdir, server, model_dir, backend, MODES[mode])
    assert_every_request_succeeded(result, server)
    ttft_after, drafts_after = histogram(server, TTFT), server.metric(DRAFTS)
    assert ttft_after.count - ttft_before.count == NUM_PROMPTS, "the server counted other requests than the bench's"
    server_ttft_s = ttft_after.mean_since(ttft_before)
    client_ttft_s = result["mean_ttft_ms"] / 1000
    assert abs(client_ttft_s - server_ttft_s) <= TTFT_RTOL * server_ttft_s, (
        f"mean TTFT {client_ttft_s:.4f} s in vllm bench, {server_ttft_s:.4f} s in the server's histogram"
    )
    assert (drafts_after > drafts_before) == (mode == "lossless"), f"{mode}: drafts {drafts_before} -> {drafts_after}"


def test_vllm_bench_serve_reports_speculative_decoding_under_vllm_names(
    vllm_venv: Path, workdir: Path, vllm_named_lossless_server: ServeProcess, model_dir: str
) -> None:
    """With `--metrics-prefix vllm` the server's series are named `vllm:...` (docs/serve.md), which is
    what vLLM's bench reads: its speculative section reports the drafts this run added, and they are real."""
    server = vllm_named_lossless_server
    counters = {field: f"vllm:spec_decode_{name}_total" for field, name in SPEC_DECODE_FIELDS.items()}
    before = {field: server.metric(name) for field, name in counters.items()}
    result = vllm_bench(vllm_venv, workdir, server, model_dir, "openai", None)
    assert_every_request_succeeded(result, server)
    assert "spec_decode_num_drafts" in result, f"vllm bench found no vllm:spec_decode_* counters: {sorted(result)}"
    for field, name in counters.items():
        assert result[field] == server.metric(name) - before[field], f"{field}: {result[field]} in vllm bench"
    assert 0 < result["spec_decode_num_drafts"] <= result["spec_decode_draft_tokens"], result
    assert 0 <= result["spec_decode_accepted_tokens"] <= result["spec_decode_draft_tokens"], result
    assert result["spec_decode_acceptance_length"] >= 1.0, result["spec_decode_acceptance_length"]
