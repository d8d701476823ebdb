"""`kvlab store`: ls, put, get, rm, stats, verify and clear against file:// and redis:// stores."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from kvlab.cli import main
from tests.helpers import free_port


@pytest.fixture(params=["file", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    return f"file://{tmp_path / 'store'}"


def _put(url: str, key: str, data: bytes, tmp_path: Path) -> None:
    source = tmp_path / f"{key}.bin"
    source.write_bytes(data)
    assert main(["store", "put", url, key, str(source)]) == 0


def test_put_then_get_to_stdout_round_trips_binary(
    url: str, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    payload = bytes(range(256)) * 3
    _put(url, "blob-1", payload, tmp_path)
    assert capsysbinary.readouterr().out == b"stored 768 bytes under blob-1\n"
    assert main(["store", "get", url, "blob-1"]) == 0
    assert capsysbinary.readouterr().out == payload


def test_put_from_stdin_and_get_to_a_file(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\x00from stdin\xff")))
    assert main(["store", "put", url, "piped", "-"]) == 0
    target = tmp_path / "out.bin"
    assert main(["store", "get", url, "piped", "-o", str(target)]) == 0
    assert target.read_bytes() == b"\x00from stdin\xff"


def test_ls_json_lists_keys_sizes_and_total(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for key, size in [("b-2", 5), ("a-1", 3), ("b-1", 0)]:
        _put(url, key, b"x" * size, tmp_path)
    capsys.readouterr()
    assert main(["store", "ls", url, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["keys"] == [{"key": "a-1", "bytes": 3}, {"key": "b-1", "bytes": 0}, {"key": "b-2", "bytes": 5}]
    assert (listing["num_keys"], listing["total_bytes"]) == (3, 8)
    assert main(["store", "ls", url, "--prefix", "b-"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split() for line in lines] == [["0", "b-1"], ["5", "b-2"], ["2", "keys,", "5", "bytes"]]


def test_rm_removes_keys_and_stats_counts_what_is_left(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for key in ("k1", "k2", "k3"):
        _put(url, key, b"1234", tmp_path)
    capsys.readouterr()
    assert main(["store", "rm", url, "k1", "k3", "never"]) == 0
    assert capsys.readouterr().out == "removed 2 of 3 keys\n"
    assert main(["store", "stats", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["num_keys"], stats["total_bytes"]) == (1, 4)
    assert main(["store", "stats", url]) == 0
    assert capsys.readouterr().out == f"{url}: 1 keys, 4 bytes\n"


def test_get_of_a_missing_key_exits_1_with_one_line(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _put(url, "present", b"1", tmp_path)
    capsys.readouterr()
    assert main(["store", "get", url, "absent"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no value under key 'absent'" in captured.err and len(captured.err.strip().splitlines()) == 1


def test_rm_with_one_bad_key_removes_nothing(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _put(url, "kept", b"1", tmp_path)
    assert main(["store", "rm", url, "kept", "../etc"]) == 2
    assert "invalid store key '../etc'" in capsys.readouterr().err
    assert main(["store", "get", url, "kept"]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["store", "ls", "nowhere"], "has no scheme"),
        (["store", "ls", "ftp://host/x"], "unknown store 'ftp'"),
        (["store", "get", "memory://", "../up"], "invalid store key"),
        (["store", "ls", "memory://", "--prefix", "a*"], "invalid key prefix"),
        (["store", "put", "memory://", "k", "/nonexistent/input.bin"], "cannot read /nonexistent/input.bin"),
        (["store", "stats", "redis://localhost/0?timeout=-1"], "timeout must be a positive number"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_unreachable_redis_exits_1_and_says_how_to_start_it(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert main(["store", "stats", f"redis://127.0.0.1:{port}/0?timeout=0.5"]) == 1
    err = capsys.readouterr().err.strip()
    assert f"redis-server --port {port}" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("verb", ["ls", "stats"])
def test_reading_a_mistyped_file_store_is_a_usage_error_and_creates_nothing(
    verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    typo = tmp_path / "no" / "such" / "store"
    assert main(["store", verb, f"file://{typo}"]) == 2
    assert "no store at" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def _filled_prefix_store(url: str) -> list[str]:
    """Keys of the chunks a tiny model's prefill saved to `url`."""
    from kvlab.generation.prefill import PrefillCaches, PrefixReuse, prefill
    from kvlab.store.prefix import PrefixCache, PrefixConfig
    from tests.helpers import tiny_llama

    model = tiny_llama(num_kv_heads=2, seed=3)
    prompt = [(7 * i + 3) % 90 + 3 for i in range(50)]
    prefix = PrefixCache.for_model(model, url, PrefixConfig(chunk_tokens=16, allow_recompute=False))
    prefill(model, [prompt], PrefillCaches(64), PrefixReuse(prefix))
    prefix.close()
    return prefix.keys(prompt, "exact")


def test_verify_finds_the_broken_value_and_delete_removes_only_it(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = _filled_prefix_store(url)
    assert main(["store", "verify", url]) == 0
    assert "3 values checked, 0 failed" in capsys.readouterr().out
    from kvlab.store import create_store

    store = create_store(url)
    store.put(keys[1], (store.get(keys[1]) or b"")[:-9])
    store.close()
    assert main(["store", "verify", url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["num_values"] == 3 and [entry["key"] for entry in report["failed"]] == [keys[1]]
    assert "truncated" in report["failed"][0]["problem"]
    assert main(["store", "verify", url, "--delete"]) == 0
    assert "removed the 1 that failed" in capsys.readouterr().out
    assert main(["store", "ls", url, "--json"]) == 0
    assert sorted(row["key"] for row in json.loads(capsys.readouterr().out)["keys"]) == sorted([keys[0], keys[2]])


def test_clear_asks_for_yes_without_a_terminal_then_removes_everything(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _put(url, "a-1", b"x", tmp_path)
    _put(url, "b-1", b"y", tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["store", "clear", url]) == 2
    assert "needs --yes" in capsys.readouterr().err
    assert main(["store", "clear", url, "--prefix", "a-", "--yes"]) == 0
    assert "removed 1 keys" in capsys.readouterr().out
    assert main(["store", "clear", url, "--yes"]) == 0
    assert "removed 1 keys" in capsys.readouterr().out
    assert main(["store", "stats", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_keys"] == 0


@pytest.mark.parametrize("verb", ["verify", "clear"])
def test_verify_and_clear_of_a_missing_store_are_usage_errors_and_create_nothing(
    verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "such" / "store"
    assert main(["store", verb, f"file://{missing}", *(["--yes"] if verb == "clear" else [])]) == 2
    assert not missing.parent.exists()
