"""Every store backend passes the same contract; keys are stable and safe."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvlab.errors import ConfigError
from kvlab.store import KVStore, StoredValueError, StoreUnavailableError, chunk_keys, create_store, fingerprint, stores
from kvlab.store.backends.file import FileStore

# One URL factory per registered scheme (the matrix must cover the registry); a factory may ask for
# fixtures through the request (redis needs the test server from conftest).
BACKENDS: dict[str, Callable[[pytest.FixtureRequest, Path], str]] = {
    "memory": lambda request, tmp: "memory://",
    "file": lambda request, tmp: f"file://{tmp / 'store'}",
    "redis": lambda request, tmp: str(request.getfixturevalue("redis_url")),
    "redis+unix": lambda request, tmp: str(request.getfixturevalue("redis_unix_url")),
    "rediss": lambda request, tmp: str(request.getfixturevalue("rediss_url")),
    "redis+cluster": lambda request, tmp: str(request.getfixturevalue("redis_cluster_url")),
}


def test_every_registered_scheme_is_tested() -> None:
    assert sorted(BACKENDS) == stores.names()


@pytest.mark.parametrize("scheme", sorted(BACKENDS))
def test_every_registered_scheme_opens_from_its_url(scheme: str) -> None:
    backend = stores.get(scheme)
    assert backend.from_url.__func__ is not KVStore.from_url.__func__, f"{scheme} does not implement from_url"  # type: ignore[attr-defined]


def test_reading_a_missing_file_store_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "store"
    with pytest.raises(ConfigError, match="no store at"):
        create_store(f"file://{missing}", create=False)
    assert not (tmp_path / "typo").exists()
    assert isinstance(create_store(f"file://{missing}"), FileStore) and missing.is_dir()


@pytest.fixture(params=sorted(BACKENDS))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[KVStore]:
    backend = create_store(BACKENDS[request.param](request, tmp_path))
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


def test_keys_lists_stored_keys_sorted_and_by_prefix(store: KVStore) -> None:
    assert store.keys() == []
    store.put_many({"b-2": b"x", "a-1": b"", "b-1": b"yy", "b": b"z", "c.9": b"w"})
    store.delete("c.9")
    assert store.keys() == ["a-1", "b", "b-1", "b-2"]
    assert store.keys("b-") == ["b-1", "b-2"]
    assert store.keys("b") == ["b", "b-1", "b-2"]
    assert store.keys("zzz") == []


def test_keys_refuses_prefixes_that_cannot_start_a_key(store: KVStore) -> None:
    with pytest.raises(ConfigError, match="invalid key prefix"):
        store.keys("a*")


def test_nbytes_is_the_value_size_or_none(store: KVStore) -> None:
    store.put("sized", b"12345")
    store.put("empty", b"")
    assert (store.nbytes("sized"), store.nbytes("empty"), store.nbytes("absent")) == (5, 0, None)


def test_a_bounded_get_reads_values_within_the_bound_and_refuses_larger_ones(store: KVStore) -> None:
    store.put("sized", bytes(range(100)))
    store.put("empty", b"")
    assert store.get("sized", max_bytes=100) == bytes(range(100))
    assert store.get("empty", max_bytes=0) == b"" and store.get("absent", max_bytes=10) is None
    with pytest.raises(StoredValueError, match="'sized' has 100 bytes, more than the 99"):
        store.get("sized", max_bytes=99)
    with pytest.raises(StoredValueError):
        store.get_many(["empty", "sized"], max_bytes=50)
    assert store.get_many(["sized", "absent"], max_bytes=100) == [bytes(range(100)), None]


def test_concurrent_clients_lose_and_corrupt_nothing(store: KVStore) -> None:
    errors: list[str] = []
    num_workers, num_rounds, num_shared = 8, 200, 5

    def payload_of(worker: int, i: int) -> bytes:
        return f"{worker}:{i}:".encode() * (i % 7 + 1)

    def is_whole(seen: bytes | None) -> bool:
        fields = (seen or b"").split(b":")
        return len(fields) > 2 and fields[0].isdigit() and fields[1].isdigit() and \
            seen == payload_of(int(fields[0]), int(fields[1]))

    def client(worker: int) -> None:
        for i in range(num_rounds):
            key, payload = f"w{worker}-{i}", payload_of(worker, i)
            store.put(key, payload)
            if store.get(key) != payload:
                errors.append(f"{key}: own key read back wrong")
            # Overlapping keys: every writer races on the same few; a reader must see one whole value.
            shared = f"shared-{i % num_shared}"
            store.put(shared, payload)
            seen = store.get(shared)
            if not is_whole(seen):
                errors.append(f"{shared}: torn or missing value {seen[:40] if seen else seen!r}")

    threads = [threading.Thread(target=client, args=(w,)) for w in range(num_workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:5]
    for w in range(num_workers):
        for i in range(num_rounds):
            assert store.get(f"w{w}-{i}") == payload_of(w, i), f"worker {w} round {i} was lost or corrupted"
    assert len(store.keys("w")) == num_workers * num_rounds
    assert store.keys("shared-") == [f"shared-{j}" for j in range(num_shared)]


def test_file_keys_never_lists_temporary_or_foreign_files(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.put("ab-1", b"kept")
    (tmp_path / "store" / "ab" / ".put-interrupted").write_bytes(b"half a value")
    (tmp_path / "store" / "ab" / "cd-not-in-its-bucket").write_bytes(b"placed by hand")
    (tmp_path / "store" / ".staging").mkdir()
    assert store.keys() == ["ab-1"]
    assert store.keys("ab") == ["ab-1"]


def test_file_read_failures_are_store_unavailable(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    # A directory where the value file should be fails like an unreadable file, even for root.
    (tmp_path / "store" / "ke" / "key-1").mkdir(parents=True)
    with pytest.raises(StoreUnavailableError, match=r"cannot read 'key-1'.*check that the directory"):
        store.get("key-1")


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
