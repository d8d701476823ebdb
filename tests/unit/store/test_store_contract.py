"""Every store backend passes the same contract; keys are stable and safe."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvlab.errors import ConfigError
from kvlab.store import KVStore, chunk_keys, create_store, fingerprint, stores

# One factory per registered scheme (the matrix must cover the registry).
BACKENDS: dict[str, Callable[[Path], str]] = {
    "memory": lambda tmp: "memory://",
    "file": lambda tmp: f"file://{tmp / 'store'}",
}


def test_every_registered_scheme_is_tested() -> None:
    assert sorted(BACKENDS) == stores.names()


@pytest.fixture(params=sorted(BACKENDS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStore]:
    backend = create_store(BACKENDS[request.param](tmp_path))
    yield backend
    backend.close()


def test_put_then_get_returns_the_same_bytes(store: KVStore) -> None:
    payload = bytes(range(256)) * 17 + b"\x00"
    store.put("chunk-a", payload)
    assert store.get("chunk-a") == payload and store.contains("chunk-a")


def test_missing_keys_read_as_none(store: KVStore) -> None:
    assert store.get("never-written") is None and not store.contains("never-written")


def test_overwrite_replaces_and_delete_removes(store: KVStore) -> None:
    store.put("k", b"first")
    store.put("k", b"second, longer")
    assert store.get("k") == b"second, longer"
    store.delete("k")
    store.delete("k")
    assert store.get("k") is None


def test_batch_put_and_get(store: KVStore) -> None:
    items = {f"key-{i}": bytes([i]) * i for i in range(10)}
    store.put_many(items)
    assert store.get_many([*items, "absent"]) == [*items.values(), None]


def test_empty_values_are_stored(store: KVStore) -> None:
    store.put("empty", b"")
    assert store.get("empty") == b""


@pytest.mark.parametrize("key", ["../escape", "a/b", "/etc/passwd", ".hidden", "", "x" * 201, "a\x00b", "ok key"])
def test_untrusted_keys_are_refused(store: KVStore, key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid store key"):
        store.put(key, b"data")
    with pytest.raises(ConfigError, match="invalid store key"):
        store.get(key)
    assert not (tmp_path / "escape").exists()


def test_only_bytes_are_stored(store: KVStore) -> None:
    with pytest.raises(TypeError, match="bytes"):
        store.put("k", "text")  # type: ignore[arg-type]


def test_concurrent_clients_lose_and_corrupt_nothing(store: KVStore) -> None:
    errors: list[str] = []

    def client(worker: int) -> None:
        for i in range(200):
            key, payload = f"w{worker}-{i}", f"{worker}:{i}:".encode() * (i % 7 + 1)
            store.put(key, payload)
            if store.get(key) != payload:
                errors.append(key)

    threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert all(store.get(f"w{w}-199") == f"{w}:199:".encode() * (199 % 7 + 1) for w in range(8))


def test_chunk_keys_chain_the_prefix_and_the_fingerprint() -> None:
    base = fingerprint("smollm2", None, {"name": "raw"})
    tokens = list(range(1000))
    keys = chunk_keys(tokens, 256, base)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert chunk_keys(tokens[:600], 256, base) == keys[:2]
    changed = tokens.copy()
    changed[10] = 99999
    assert chunk_keys(changed, 256, base)[1] != keys[1], "a change early in the prefix must change later keys"
    assert chunk_keys(tokens, 256, fingerprint("smollm2", {"name": "kivi", "bits": 4}, {"name": "raw"}))[0] != keys[0]


def test_chunk_keys_are_stable_across_processes() -> None:
    code = (
        "from kvlab.store import chunk_keys, fingerprint;"
        "print(chunk_keys(list(range(512)), 256, fingerprint('m', None, None))[1])"
    )
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
               for _ in range(2)}
    assert outputs == {chunk_keys(list(range(512)), 256, fingerprint("m", None, None))[1] + "\n"}


@pytest.mark.parametrize(("url", "message"), [("nowhere", "has no scheme"), ("ftp://x", "unknown store 'ftp'"),
                                               ("file://host/path", "file:///absolute/path")])
def test_bad_urls_are_config_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_store(url)
