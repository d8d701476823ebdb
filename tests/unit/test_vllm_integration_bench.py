"""benchmarks/vllm_integration.py without vLLM: only the redis:// rows start (or need) a redis-server, and
without one they stop the run with one line that says how to get it."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_integration.py"
REDIS_ROWS = ["kvlab redis:// exact", "kvlab redis:// adaptive"]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_integration_bench", SCRIPT)
    assert spec is not None and spec.loader is not None, f"cannot load {SCRIPT}"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_redis_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A PATH without redis-server, as on a machine after `make demo` and `make vllm-setup` only."""
    monkeypatch.setenv("PATH", str(tmp_path))


def test_only_the_redis_rows_need_a_redis_server(bench: ModuleType) -> None:
    rows = bench.CONNECTOR_ROWS + bench.DECODE_ROWS
    assert [row for row in rows if bench.needs_redis(row)] == REDIS_ROWS


@pytest.mark.usefixtures("no_redis_server")
def test_rows_without_a_store_run_without_redis_server(bench: ModuleType) -> None:
    others = [row for row in bench.CONNECTOR_ROWS + bench.DECODE_ROWS if row not in REDIS_ROWS]
    assert bench.missing_redis_server(others) is None


@pytest.mark.usefixtures("no_redis_server")
def test_a_redis_row_without_redis_server_says_in_one_line_how_to_get_it(bench: ModuleType) -> None:
    message = bench.missing_redis_server(["decode: vllm plain", *REDIS_ROWS])
    assert message is not None and "\n" not in message, message
    assert "scripts/ensure-redis-server" in message and "apt-get install redis-server" in message, message
    assert all(repr(row) in message for row in REDIS_ROWS) and "decode" not in message, message


@pytest.mark.usefixtures("no_redis_server")
def test_main_stops_before_any_row_when_a_redis_row_cannot_run(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
        raise AssertionError("rows ran although a redis:// row cannot")

    monkeypatch.setattr(bench, "parent", no_rows)
    assert bench.main(["--rows", "decode: vllm plain", "kvlab redis:// exact"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "scripts/ensure-redis-server" in err, err


@pytest.mark.usefixtures("no_redis_server")
def test_decode_rows_run_without_starting_redis_server(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    def measured(args: argparse.Namespace, row: str, phase: str, where: str = "") -> dict[str, Any]:
        assert where == "", f"{row} was handed a store: {where}"
        return {"ttft_s": 1.0, "tokens": [1, 2], "decode_tokens_per_s": 10.0}

    def no_server(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
        raise AssertionError("redis-server started for rows that use no store")

    monkeypatch.setattr(bench, "spawn", measured)
    monkeypatch.setattr(bench, "start_redis", no_server)
    rows = ["vllm cold", *bench.DECODE_ROWS]
    args = argparse.Namespace(rows=rows, prefix_tokens=64, prompt="doc", batch=1)
    assert [row["setting"] for row in bench.parent(args)] == rows


def test_the_loopback_server_starts_once_at_the_first_url_and_stops(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started: list[Path] = []

    class Server:
        def __init__(self) -> None:
            self.stopped = False

        def terminate(self) -> None:
            self.stopped = True

        def wait(self) -> int:
            return 0

    server = Server()

    def start(workdir: Path) -> tuple[Server, str]:
        started.append(workdir)
        return server, "redis://127.0.0.1:1/0"

    monkeypatch.setattr(bench, "start_redis", start)
    unused = bench.LoopbackRedis(tmp_path)
    unused.stop()
    assert started == [], "a server no row asked for was started"
    loopback = bench.LoopbackRedis(tmp_path)
    assert loopback.url() == loopback.url() == "redis://127.0.0.1:1/0"
    assert started == [tmp_path], f"started {len(started)} times for two rows"
    loopback.stop()
    assert server.stopped


def test_a_decode_row_may_name_its_own_speculative_tokens(bench: ModuleType) -> None:
    assert bench.row_tokens("decode: ngram k=8", 4) == ("decode: ngram", 8)
    assert bench.row_tokens("decode: ngram", 4) == ("decode: ngram", 4)
    assert bench.row_setting("decode: kvlab proposer + hand-over k=8") == "decode: kvlab proposer + hand-over k=8"
    for wrong in ("decode: vllm plain k=8", "vllm cold k=2", "decode: ngram k=0", "decode: nothing"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.row_setting(wrong)


def test_ratios_over_ngram_are_over_its_fastest_row(bench: ModuleType) -> None:
    rows = [{"setting": setting, "decode_tokens_per_s": rate, "request_ttft_s": ttft}
            for setting, rate, ttft in (("decode: vllm plain", 10.0, 2.0), ("decode: ngram", 12.0, 2.0),
                                        ("decode: ngram k=8", 15.0, 4.0), ("decode: kvlab proposer k=8", 18.0, 2.0))]
    bench.add_decode_ratios(rows, "doc", 1)
    kvlab = rows[-1]
    assert (kvlab["decode_x_plain"], kvlab["decode_x_ngram"], kvlab["request_ttft_x_ngram"]) == (1.8, 1.2, 0.5)
