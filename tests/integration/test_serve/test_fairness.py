"""Issue 33's attacks on `kvlab serve`, each against a real server process on loopback: one request
cannot lock the others out of the token budget (a share per request, and a line to wait in rather than a
429), a long prompt cannot hold up later arrivals, a failed request is a 500 naming it (never an
answer), SIGTERM ends the process within its timeout, and the start-up banner is the CLI's."""

from __future__ import annotations

import ast
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.client import HTTPResponse
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_serve.server import ServeProcess

pytestmark = pytest.mark.integration

# Prompts that start with these token ids fail in the engine: their first prefill piece raises (see
# FAULT_HOOK), as a forward that fails would, while every other request runs as usual.
MARKER = [4242, 4243, 4244, 4245]
FAULT_HOOK = f'''
"""Test-only: make the prefill of a prompt that starts with {MARKER} raise, once kvlab loads it."""
import importlib.abc
import importlib.util
import sys

MARKER = {MARKER}


def _patch(module):
    step = module.PromptPrefill.step

    def failing_step(self):
        if list(self.prompt[: len(MARKER)]) == MARKER:
            raise RuntimeError("injected: the forward failed")
        return step(self)

    module.PromptPrefill.step = failing_step


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "kvlab.generation.prefill":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
'''
# The attack of issue 33: 64 prompts x (1 + 2047) tokens, exactly the default --max-tokens-in-system.
LOCKOUT = {"prompt": [[42]] * 64, "max_tokens": 2047, "ignore_eos": True, "stream": True}
HANG_GUARD_S = 120  # waits that only keep a broken server from hanging the suite: never measurements


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """Default token limits, 4 running requests (a share of 131072 / 4 tokens each), 32-token prefill
    pieces, and the fault hook for prompts that start with MARKER."""
    workdir = tmp_path_factory.mktemp("fairness")
    hooks = workdir / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAULT_HOOK)
    path = os.pathsep.join(part for part in (str(hooks), os.environ.get("PYTHONPATH", "")) if part)
    process = ServeProcess(workdir, "--max-num-seqs", "4", "--prefill-chunk-tokens", "32", env={"PYTHONPATH": path})
    yield process
    process.stop()


@pytest.fixture(scope="module")
def small_budget(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """600 tokens in the system, which one request may take whole, and one request at most waiting for them."""
    process = ServeProcess(tmp_path_factory.mktemp("budget"), "--max-tokens-in-system", "600",
                           "--max-tokens-per-request", "600", "--max-num-seqs", "2", "--max-queued-requests", "1")
    yield process
    process.stop()


def samples(server: ServeProcess) -> dict[tuple[str, str], float]:
    """/metrics as {(sample name, its label other than model_name or ""): value}."""
    _, text = server.get("/metrics")
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = [value for key, value in sample.labels.items() if key != "model_name"]
            values[(sample.name, ",".join(labels))] = float(sample.value)
    return values


def failures(server: ServeProcess, reason: str) -> float:
    return samples(server).get(("kvlab:request_failure_total", reason), 0.0)


def open_stream(server: ServeProcess, body: dict[str, Any]) -> HTTPResponse:
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    response: HTTPResponse = urllib.request.urlopen(request, timeout=HANG_GUARD_S)
    return response


def events(stream: HTTPResponse) -> list[bytes]:
    return [line.strip() for line in stream if line.strip()]


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


# ----- one request cannot take the whole token budget


def test_one_request_cannot_take_the_whole_token_budget(server: ServeProcess) -> None:
    status, body = server.post("/v1/completions", LOCKOUT)
    assert status == 400, body
    message = body["error"]["message"]
    assert "131072 tokens" in message and "at most 32768" in message, message
    assert "--max-tokens-per-request" in message, f"the 400 must name the flag that sets the limit: {message}"
    assert samples(server)[("kvlab:num_tokens_in_system", "")] == 0, "a refused request held tokens"
    status, body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200, body


def test_tokens_that_do_not_fit_wait_in_line_and_a_full_line_is_429(small_budget: ServeProcess) -> None:
    holder = open_stream(small_budget, {"prompt": [100] * 8, "max_tokens": 580, "ignore_eos": True})  # 588 of 600
    assert holder.readline().startswith(b"data: ")
    waiter: list[tuple[int, dict[str, Any]]] = []
    thread = threading.Thread(target=lambda: waiter.append(
        small_budget.post("/v1/completions", {"prompt": [101] * 4, "max_tokens": 20, "ignore_eos": True})))  # 612 > 600
    thread.start()
    wait_until(lambda: samples(small_budget)[("kvlab:num_requests_waiting", "")] == 1, "the request waits for tokens")
    assert not waiter, f"a request whose tokens do not fit was answered instead of waiting: {waiter}"
    # 14 tokens would fit, but one request waits before it (first come, first served) and fills the line.
    status, body = small_budget.post("/v1/completions", {"prompt": [102] * 4, "max_tokens": 10})
    assert status == 429 and body["error"]["code"] == "tokens_full", body
    assert "wait for tokens" in body["error"]["message"], body
    holder.close()  # its client goes away: its tokens go back, and the waiter's turn comes
    thread.join(timeout=HANG_GUARD_S)
    assert waiter and waiter[0][0] == 200, waiter
    assert waiter[0][1]["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: samples(small_budget)[("kvlab:num_tokens_in_system", "")] == 0, "every token is given back")
    assert samples(small_budget)[("kvlab:num_requests_waiting", "")] == 0


def test_a_waiter_whose_client_goes_away_leaves_the_line(small_budget: ServeProcess) -> None:
    cancelled_before = failures(small_budget, "cancelled")
    holder = open_stream(small_budget, {"prompt": [100] * 8, "max_tokens": 580, "ignore_eos": True})
    assert holder.readline().startswith(b"data: ")
    leaving = http.client.HTTPConnection("127.0.0.1", small_budget.port, timeout=HANG_GUARD_S)
    leaving.request("POST", "/v1/completions", json.dumps({"prompt": [101] * 4, "max_tokens": 20}),
                    {"Content-Type": "application/json"})
    wait_until(lambda: samples(small_budget)[("kvlab:num_requests_waiting", "")] == 1, "the request waits for tokens")
    leaving.close()
    wait_until(lambda: samples(small_budget)[("kvlab:num_requests_waiting", "")] == 0, "the waiter leaves the line")
    assert failures(small_budget, "cancelled") == cancelled_before + 1
    # The line has room again: the next request waits rather than getting a 429.
    waiter: list[tuple[int, dict[str, Any]]] = []
    thread = threading.Thread(target=lambda: waiter.append(
        small_budget.post("/v1/completions", {"prompt": [101] * 4, "max_tokens": 20})))
    thread.start()
    wait_until(lambda: samples(small_budget)[("kvlab:num_requests_waiting", "")] == 1, "the next request waits")
    holder.close()
    thread.join(timeout=HANG_GUARD_S)
    assert waiter and waiter[0][0] == 200, waiter
    wait_until(lambda: samples(small_budget)[("kvlab:num_tokens_in_system", "")] == 0, "every token is given back")


# ----- a long prompt cannot hold up later arrivals


def test_a_short_request_finishes_while_a_long_prompt_is_still_prefilling(server: ServeProcess) -> None:
    long_prompt = [(37 * i) % 5000 + 100 for i in range(2000)]  # 63 pieces of 32 tokens
    before = samples(server).get(("kvlab:prefix_recomputed_tokens_total", ""), 0.0)
    order: list[str] = []
    lock = threading.Lock()

    def read_long() -> None:
        with open_stream(server, {"prompt": long_prompt, "max_tokens": 2, "temperature": 0}) as stream:
            stream.readline()  # its first token comes once its whole prompt is prefilled
            with lock:
                order.append("long prefilled")
            events(stream)

    reader = threading.Thread(target=read_long)
    reader.start()
    wait_until(lambda: samples(server).get(("kvlab:prefix_recomputed_tokens_total", ""), 0.0) >= before + 64,
               "the long prompt's prefill starts")
    status, body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    with lock:
        order.append("short finished")
    recomputed = samples(server)[("kvlab:prefix_recomputed_tokens_total", "")] - before  # pieces started by now
    reader.join(timeout=HANG_GUARD_S)
    assert status == 200, body
    assert order == ["short finished", "long prefilled"], f"the short request waited for the long prefill: {order}"
    short_tokens = body["usage"]["prompt_tokens"]
    pieces_done = (recomputed - short_tokens) // 32
    assert pieces_done < len(long_prompt) // 32, (
        f"{pieces_done} of the long prompt's {len(long_prompt) // 32} pieces had run when the short request finished"
    )


# ----- a failed request is a failure, never an answer


def test_a_failed_request_is_a_500_naming_it_and_counted_as_an_error(server: ServeProcess) -> None:
    errors_before = failures(server, "error")
    successes_before = {key: value for key, value in samples(server).items() if key[0] == "kvlab:request_success_total"}
    status, body = server.post("/v1/completions", {"prompt": [*MARKER, 500, 501], "max_tokens": 4})
    assert status == 500, body
    error = body["error"]
    assert error["type"] == "internal_error", error
    assert re.search(r"request cmpl-[0-9a-f]{32} failed \(RuntimeError\)", error["message"]), error
    assert "injected" not in error["message"], f"the error's own message (paths, values) went to the client: {error}"
    assert re.search(r"request cmpl-[0-9a-f]{32} failed: RuntimeError: injected", server.log.read_text()), (
        "the log has no line naming the failed request and its error"
    )
    assert failures(server, "error") == errors_before + 1
    after = {key: value for key, value in samples(server).items() if key[0] == "kvlab:request_success_total"}
    assert after == successes_before, "a failed request was counted as a success"
    status, body = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert status == 200, f"the server did not go on after a failed request: {body}"


def test_a_failed_stream_ends_with_an_error_event_then_done(server: ServeProcess) -> None:
    errors_before = failures(server, "error")
    with open_stream(server, {"prompt": [*MARKER, 500, 501], "max_tokens": 4}) as stream:
        lines = events(stream)
    assert lines[-1] == b"data: [DONE]", lines
    error = json.loads(lines[-2].removeprefix(b"data: "))["error"]
    assert error["type"] == "internal_error", error
    assert re.search(r"request cmpl-[0-9a-f]{32} failed \(RuntimeError\)", error["message"]), error
    assert not any(b'"finish_reason":"' in line for line in lines), f"a failed stream carried a finish: {lines}"
    assert failures(server, "error") == errors_before + 1


# ----- SIGTERM and the banner


def test_sigterm_ends_the_process_within_its_timeout_and_the_stream_cleanly(tmp_path: Path) -> None:
    timeout_s = 4
    server = ServeProcess(tmp_path, "--shutdown-timeout", str(timeout_s), "--max-num-seqs", "2")
    try:
        with open_stream(server, {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}) as stream:
            assert stream.readline().startswith(b"data: ")
            server.terminate()
            lines = events(stream)
            code = server.process.wait(timeout=timeout_s + 15)  # a hang guard, not a speed claim
        assert code == 0, server.log.read_text(errors="replace")[-2000:]
        assert lines[-1] == b"data: [DONE]" and b'"code":"shutting_down"' in lines[-2], lines[-3:]
        assert "Traceback" not in server.log.read_text(errors="replace")
    finally:
        server.stop()


def test_the_banner_is_printed_by_the_cli_once(server: ServeProcess) -> None:
    log = server.log.read_text(errors="replace")
    banner = f"kvlab serve: smollm2 on http://127.0.0.1:{server.port} (mode plain; 4 running"
    assert log.count(banner) == 1, log[:2000]


# Run in a child process: `run_server` configures uvicorn's logging, installs signal handlers and starts
# the engine's thread, none of which may leak into the test process (uvicorn's handlers would write to this
# test's captured stderr after it is closed).
LIBRARY_START = """
import sys
import kvlab.serve.server as server_module
from kvlab.serve.config import ServeConfig
from tests.helpers import tiny_llama

loaded = tiny_llama()
server_module.load_configured_model = lambda settings: loaded
server_module.DrainingServer.run = lambda self, sockets=None: None  # serves nothing
started = []
code = server_module.run_server(ServeConfig(port=0), on_start=started.append)
print(repr((code, [(start.model_name, start.url) for start in started], loaded.name)), file=sys.__stderr__)
"""


def test_the_library_prints_nothing_and_reports_its_start() -> None:
    root = Path(__file__).resolve().parents[3]
    child = subprocess.run([sys.executable, "-c", LIBRARY_START], cwd=root, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert child.stdout == "", f"the library printed: {child.stdout!r}"
    code, started, name = ast.literal_eval(child.stderr.strip().splitlines()[-1])
    assert child.stderr.strip().count("\n") == 0, f"the library printed: {child.stderr!r}"
    assert code == 1, "uvicorn never started, so run_server must say it failed"
    assert started == [(name, "http://127.0.0.1:0")]


def test_the_no_secret_warning_is_logged_once_per_store_however_many_cache_salts(tmp_path: Path) -> None:
    env = {key: "" for key in ("KVLAB_STORE_SECRET", "KVLAB_STORE_SECRET_FILE")}
    store = f"file://{tmp_path / 'store'}"
    process = ServeProcess(tmp_path, "--prefix-store", store, "--prefix-chunk-tokens", "16", env=env)
    try:
        for salt in ("tenant-a", "tenant-b", "tenant-c"):
            status, reply = process.post("/v1/completions", {
                "model": "smollm2", "prompt": list(range(100, 140)), "max_tokens": 2, "kvlab": {"cache_salt": salt},
            })
            assert status == 200, reply
    finally:
        process.stop()
    log = process.log.read_text(errors="replace")
    assert log.count("chunks are not authenticated") == 1, log[-3000:]
