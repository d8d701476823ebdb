"""The HTTP side of `kvlab serve` against an attacker on this machine (real server processes on loopback):
web pages and DNS rebinding cannot drive it, bodies and prompts are bounded before they cost memory,
every field is bounded before use, the key never shows in `ps`, and a drain ends requests cleanly."""

from __future__ import annotations

import http.server
import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvlab.compress import compressors
from kvlab.serve.body import MAX_BODY_BYTES, MAX_INT_DIGITS, MAX_JSON_DEPTH
from tests.helpers import free_port
from tests.integration.test_serve.server import ServeProcess
from tests.integration.test_serve.test_page import chromium

KEY = "a-key-only-the-file-holds"
PROMPT_40 = [(7 * i + 3) % 90 + 3 for i in range(40)]  # token ids: exactly 40 prompt tokens
MAX_PROMPT_TOKENS = 64
CHARS_PER_TOKEN = 32  # the bound README states (kvlab.serve.options.MAX_CHARS_PER_TOKEN)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    process = ServeProcess(tmp_path_factory.mktemp("serve"), "--model", str(tiny_model_dir), "--max-num-seqs", "4",
                           "--max-prompt-tokens", str(MAX_PROMPT_TOKENS))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def guarded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """A key from a file others may read, one allowed origin, and 500 tokens in the system at most, which one
    request may take whole, with no line to wait in for them (429 at once)."""
    workdir = tmp_path_factory.mktemp("guarded")
    key_file = workdir / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o644)
    # --api-key-file wins over a KVLAB_API_KEY the environment may hold.
    process = ServeProcess(workdir, "--model", str(tiny_model_dir), "--api-key-file", str(key_file),
                           "--allowed-origins", "https://app.example", "--max-tokens-in-system", "500",
                           "--max-tokens-per-request", "500", "--max-queued-requests", "0")
    yield process
    process.stop()


def metric(server: ServeProcess, name: str) -> float:
    try:
        return server.metric(name)
    except AssertionError:  # a counter that never moved has no sample yet
        return 0.0


def raw_request(port: int, head: bytes, chunks: Iterable[bytes] = (), timeout_s: float = 60) -> bytes:
    """Send `head` then `chunks` (stopping once the server answers or closes), and return its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as connection:
        connection.sendall(head)
        try:
            for chunk in chunks:
                if select.select([connection], [], [], 0)[0]:
                    break  # it answered before the body ended
                connection.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = b""
        try:
            while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
                data = connection.recv(65536)
                if not data:
                    break
                reply += data
        except ConnectionResetError:
            pass
    return reply


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


# ----- web pages and DNS rebinding


ATTACK_PAGE = """<!doctype html><html><body>
<form id="f" method="POST" enctype="text/plain" action="{action}">
<input name='{{"prompt": "w5 w6 w7", "max_tokens": 4, "pad": "' value='"}}'>
</form><script>document.getElementById("f").submit();</script></body></html>"""


class _AttackHandler(http.server.BaseHTTPRequestHandler):
    page = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(self.page)))
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_cross_site_text_plain_form_in_a_browser_does_not_reach_the_server(server: ServeProcess) -> None:
    from playwright.sync_api import sync_playwright

    page_bytes = ATTACK_PAGE.format(action=server.url + "/v1/completions").encode()
    handler = type("Handler", (_AttackHandler,), {"page": page_bytes})
    attacker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    before = metric(server, "kvlab:prompt_tokens_total")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
            try:
                page = browser.new_page()
                # Another site: `localhost` on another port, while the server is addressed as 127.0.0.1.
                with page.expect_response(lambda r: r.url.startswith(server.url), timeout=60_000) as answer:
                    page.goto(f"http://localhost:{attacker.server_address[1]}/")
                status = answer.value.status
            finally:
                browser.close()
    finally:
        attacker.shutdown()
        attacker.server_close()
    assert status in (403, 415), f"the cross-site form got {status}"
    assert metric(server, "kvlab:prompt_tokens_total") == before, "the cross-site form's prompt was run"


def test_a_rebound_host_name_is_refused(server: ServeProcess) -> None:
    body = json.dumps({"prompt": "w5 w6", "max_tokens": 2}).encode()
    for method, path, payload in (("GET", "/v1/models", b""), ("POST", "/v1/completions", body)):
        head = (f"{method} {path} HTTP/1.1\r\nHost: attacker.example:{server.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                "Connection: close\r\n\r\n").encode() + payload
        reply = raw_request(server.port, head)
        assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
        assert b"invalid_host" in reply


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_bodies_that_are_not_declared_json_are_refused_with_415(server: ServeProcess, content_type: str) -> None:
    status, body = server.post("/v1/completions", {"prompt": "w5", "max_tokens": 1}, {"Content-Type": content_type})
    assert status == 415, body


def test_cors_headers_and_preflights_go_to_allowed_origins_only(guarded: ServeProcess) -> None:
    def preflight(origin: str) -> tuple[int, dict[str, str]]:
        request = urllib.request.Request(guarded.url + "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        })
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, dict(response.headers)
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers)

    status, headers = preflight("https://app.example")
    assert status == 204 and headers.get("access-control-allow-origin") == "https://app.example", headers
    status, headers = preflight("https://attacker.example")
    assert status == 403 and "access-control-allow-origin" not in {k.lower() for k in headers}, headers
    status, reply = guarded.post("/v1/completions", {"prompt": "w5", "max_tokens": 1},
                                 {"Authorization": f"Bearer {KEY}", "Origin": "https://attacker.example"})
    assert status == 403 and reply["error"]["code"] == "origin_not_allowed", reply


# ----- bodies and prompts bounded before they cost memory


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(server: ServeProcess) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {1 << 30}\r\n\r\n").encode()
    reply = raw_request(server.port, head, timeout_s=30)  # no body is sent: only an early answer ends this
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_a_chunked_body_is_cut_at_the_limit(server: ServeProcess) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    piece = b"x" * (1 << 20)
    # Past the limit and never terminated: only a server that counts as it reads answers.
    chunks = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(MAX_BODY_BYTES // len(piece) + 4))
    rss_before = rss_bytes(server.process.pid)
    reply = raw_request(server.port, head, chunks, timeout_s=30)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    grown = rss_bytes(server.process.pid) - rss_before
    assert grown < 3 * MAX_BODY_BYTES, f"the server grew by {grown >> 20} MiB on a cut body"
    assert server.get("/health")[0] == 200


def test_a_huge_prompt_is_refused_by_its_length_in_characters_before_tokenizing(server: ServeProcess) -> None:
    rss_before = rss_bytes(server.process.pid)
    status, body = server.post("/v1/completions", {"prompt": "w5 " * (5 << 20), "max_tokens": 1})  # 15 MiB
    assert status == 400 and "characters" in body["error"]["message"], body
    grown = rss_bytes(server.process.pid) - rss_before
    assert grown < 256 << 20, f"refusing a 15 MiB prompt grew the server by {grown >> 20} MiB"


def test_the_character_bound_is_stated_per_token_of_the_prompt_limit(server: ServeProcess) -> None:
    limit = MAX_PROMPT_TOKENS * CHARS_PER_TOKEN
    status, body = server.post("/v1/completions", {"prompt": "w5" + " " * (limit - 1), "max_tokens": 1})
    assert status == 400 and f"at most {limit}" in body["error"]["message"], body
    # At the bound the text is tokenized and checked in tokens as before (one token: served).
    status, body = server.post("/v1/completions", {"prompt": "w5" + " " * (limit - 2), "max_tokens": 1})
    assert status == 200, body


def test_chat_messages_are_bounded_in_characters_together(server: ServeProcess) -> None:
    half = MAX_PROMPT_TOKENS * CHARS_PER_TOKEN // 2 + 1
    text = "w5 " * (half // 3 + 1)  # each message alone is within the bound
    messages = [{"role": "system", "content": text}, {"role": "user", "content": text}]
    status, body = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert status == 400 and "characters" in body["error"]["message"], body


def test_the_tokens_in_the_system_are_bounded_with_429(guarded: ServeProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    long = {"prompt": "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14", "max_tokens": 480, "stream": True,
            "kvlab": {"ignore_eos": True}}  # holds 490 of the 500 tokens until it ends
    request = urllib.request.Request(guarded.url + "/v1/completions", data=json.dumps(long).encode(), headers=auth)
    with urllib.request.urlopen(request, timeout=120) as stream:
        assert stream.readline().startswith(b"data: ")
        status, body = guarded.post("/v1/completions", {"prompt": "w5 w6", "max_tokens": 20}, auth)
        assert status == 429 and body["error"]["code"] == "tokens_full", body
        lines = [line.strip() for line in stream if line.strip()]
    assert lines[-1] == b"data: [DONE]"
    assert guarded.metric("kvlab:num_tokens_in_system") == 0
    status, body = guarded.post("/v1/completions", {"prompt": "w5 w6", "max_tokens": 20}, auth)
    assert status == 200, body
    status, body = guarded.post("/v1/completions", {"prompt": "w5 w6", "max_tokens": 499}, auth)
    assert status == 400 and "max_tokens_in_system" in body["error"]["message"], body


# ----- every field bounded before use


def nested(depth: int) -> bytes:
    return b'{"prompt": "w5", "stop": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (nested(100_000), f"deeper than {MAX_JSON_DEPTH} levels"),
        (nested(MAX_JSON_DEPTH + 8), f"deeper than {MAX_JSON_DEPTH} levels"),
        (b'{"prompt": "w5", "max_tokens": ' + b"9" * 5000 + b"}",
         f"max_tokens: integers are limited to {MAX_INT_DIGITS}"),
        (b'{"prompt": "w5", "seed": -' + b"9" * 25 + b"}", "seed: integers are limited"),
        (b'{"prompt": "w5", "temperature": NaN}', "temperature: NaN is not a JSON number"),
        (b'{"prompt": "w5", "stop": [' + b"[]," * (1 << 20) + b"[]]}", "more than 1048576 JSON values"),
        (b'{"prompt": "w5", "top_p": 1e999}', "top_p: 1e999 is out of the range"),
    ],
)
def test_nesting_and_numbers_are_bounded_in_the_parser(server: ServeProcess, raw: bytes, message: str) -> None:
    status, body = server.post("/v1/completions", raw)
    assert status == 400, body
    assert message in body["error"]["message"], body


DRAFTER_INTEGERS = [
    (name, parameter.name)
    for name in compressors.names()
    for parameter in compressors.parameters(name)
    if parameter.type in ("int", "int | None")
]


def test_the_drafter_matrix_covers_every_compressor() -> None:
    assert {name for name, _ in DRAFTER_INTEGERS} == set(compressors.names())


@pytest.mark.parametrize(("drafter", "parameter"), DRAFTER_INTEGERS)
@pytest.mark.parametrize("value", [(1 << 63) + 1, -(1 << 63), 10**12 + 1])
def test_every_drafter_integer_out_of_range_is_a_400_naming_it(
    server: ServeProcess, drafter: str, parameter: str, value: int
) -> None:
    body = {"prompt": PROMPT_40, "max_tokens": 2, "kvlab": {"mode": "lossy", "drafter": drafter,
                                                             "drafter_args": {parameter: value}}}
    status, reply = server.post("/v1/completions", body)
    assert status == 400, f"{drafter} {parameter}={value}: {status} {reply}"
    assert parameter in reply["error"]["message"], reply


@pytest.mark.parametrize("mode", ["lossy", "lossless"])
def test_a_drafter_budget_larger_than_the_prompt_is_a_400(server: ServeProcess, mode: str) -> None:
    body = {"prompt": PROMPT_40, "max_tokens": 2, "kvlab": {"mode": mode, "drafter_args": {"budget": 41}}}
    status, reply = server.post("/v1/completions", body)
    assert status == 400 and "budget 41 is larger than the prompt" in reply["error"]["message"], reply
    body["kvlab"]["drafter_args"] = {"budget": 40}  # type: ignore[index]
    assert server.post("/v1/completions", body)[0] == 200


# ----- the API key


def test_a_key_on_the_command_line_is_refused(tiny_model_dir: Path) -> None:
    command = [sys.executable, "-m", "kvlab.cli", "serve", "--model", str(tiny_model_dir), "--port", str(free_port()),
               "--api-key", KEY]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--api-key-file" in result.stderr and "KVLAB_API_KEY" in result.stderr
    assert KEY not in result.stderr


def test_the_key_comes_from_a_file_that_ps_never_shows_and_a_readable_file_is_warned_of(guarded: ServeProcess) -> None:
    assert KEY.encode() not in Path(f"/proc/{guarded.process.pid}/cmdline").read_bytes()
    assert "readable by other users" in guarded.log.read_text(errors="replace")
    assert guarded.post("/v1/completions", {"prompt": "w5", "max_tokens": 1})[0] == 401
    status, body = guarded.post("/v1/completions", {"prompt": "w5", "max_tokens": 1},
                                {"Authorization": f"Bearer {KEY}"})
    assert status == 200, body


# ----- draining on SIGTERM


def test_a_drain_answers_health_with_503_and_ends_cut_requests_cleanly(tmp_path: Path) -> None:
    # The embedded model decodes slowly enough on a CPU that both requests outlive the 3 s drain.
    server = ServeProcess(tmp_path, "--shutdown-timeout", "3", "--max-num-seqs", "2")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "kvlab": {"ignore_eos": True}}
        plain: list[tuple[int, dict[str, Any]]] = []
        waiter = threading.Thread(target=lambda: plain.append(server.post("/v1/completions", body)))
        waiter.start()
        request = urllib.request.Request(server.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({**body, "stream": True}).encode())
        with urllib.request.urlopen(request, timeout=120) as stream:
            assert stream.readline().startswith(b"data: ")
            deadline = time.monotonic() + 60
            while server.metric("kvlab:num_requests_running") < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            server.process.send_signal(signal.SIGTERM)
            health: tuple[int, str] = (200, "")
            deadline = time.monotonic() + 2
            while health[0] == 200 and time.monotonic() < deadline:
                try:
                    health = server.get("/health")
                except (urllib.error.URLError, ConnectionError) as error:
                    health = (0, f"no answer: {error}")
                time.sleep(0.02)
            events = [line.strip() for line in stream if line.strip()]
        waiter.join(timeout=60)
        assert health[0] == 503 and "shutting down" in health[1], health
        assert events[-1] == b"data: [DONE]", events[-3:]
        assert b'"code":"shutting_down"' in events[-2], events[-3:]
        assert plain and plain[0][0] == 503 and plain[0][1]["error"]["code"] == "shutting_down", plain
        assert server.process.wait(timeout=60) == 0
        log = server.log.read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]
    finally:
        server.stop()
