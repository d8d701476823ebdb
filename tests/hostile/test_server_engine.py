"""No single request stops `kvlab serve`: out-of-range fields are refused with a 400 before they reach
the engine thread, and requests already streaming go on (a real server process on loopback)."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlab.cli import main
from tests.integration.test_serve.server import ServeProcess

SEEDS_PAST_THE_GENERATOR = [1 << 64, -(1 << 63) - 1, 1 << 70]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    process = ServeProcess(tmp_path_factory.mktemp("serve"), "--model", str(tiny_model_dir), "--max-num-seqs", "4")
    yield process
    process.stop()


def stream_tokens(server: ServeProcess, prompt: str, max_tokens: int, out: list[str]) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "kvlab": {"ignore_eos": True}}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.strip():
                out.append(line.decode().strip())


@pytest.mark.parametrize("seed", SEEDS_PAST_THE_GENERATOR)
def test_a_seed_past_the_generator_range_is_a_400_and_streaming_requests_go_on(server: ServeProcess, seed: int) -> None:
    streams: list[list[str]] = [[] for _ in range(3)]
    threads = [threading.Thread(target=stream_tokens, args=(server, f"w{i} w{i + 1} w{i + 2}", 48, streams[i]))
               for i in range(3)]
    for thread in threads:
        thread.start()
    status, body = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0.5, "seed": seed})
    assert status == 400, f"seed {seed}: {status} {body}"
    assert "seed" in body["error"]["message"], body
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a streaming request froze after the bad request"
    for index, lines in enumerate(streams):
        assert lines and lines[-1] == "data: [DONE]", f"stream {index} did not finish: {lines[-3:]}"
        assert not any('"error"' in line for line in lines), f"stream {index} failed: {lines}"
    assert server.get("/health")[0] == 200
    status, body = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0.5, "seed": 7})
    assert status == 200, body


@pytest.mark.parametrize("seed", [str(1 << 64), str(-(1 << 63) - 1)])
def test_kvlab_generate_refuses_a_seed_past_the_generator_range_as_a_usage_error(
    tiny_model_dir: Path, seed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["generate", "--model", str(tiny_model_dir), "--raw", "--prompt", "x", "--max-new-tokens", "2",
                 "--temperature", "0.5", "--seed", seed])
    assert code == 2, capsys.readouterr().err
    assert "seed must be a 64-bit integer" in capsys.readouterr().err
