"""Hostile values a co-writer can put in a shared store beyond the corpus: a huge (sparse) file, a huge
Redis string, a Redis key of another type, a hard-linked file. Each is one fault of its chunk: refused
before it is read, the chunks before it reused, output identical, one warning, the value rewritten."""

from __future__ import annotations

import json
import logging
import os
import tracemalloc
from pathlib import Path

import pytest
import redis

from kvlab.cli import main
from kvlab.engine import generate
from kvlab.models import LoadedModel
from kvlab.store import ChunkSealer, KVStore, StoredValueError, create_store
from kvlab.store.backends.file import FileStore
from kvlab.store.backends.redis import NAMESPACE
from kvlab.store.prefix import PrefixCache
from kvlab.store.resolution import exact_resolutions
from tests.hostile.conftest import CHUNK, CONFIG, OTHER, SECRET, VICTIM, plant, prefix_config
from tests.unit.store.conftest import redis_cluster, redis_cluster_url  # noqa: F401 - the cluster fixtures
from tests.unit.store.redis_cluster_nodes import LocalRedisCluster

SPARSE_BYTES = 3 << 30  # the size an attacker used; `truncate` makes it without writing a byte
MODES = [None, SECRET]
MODE_IDS = ["no-secret", "secret"]


def filled(model: LoadedModel, url: str, secret: bytes | None) -> tuple[KVStore, str, list[int]]:
    """A store at `url` holding VICTIM's two reusable chunks; returns it, chunk 1's key and the recomputed output."""
    store = create_store(url)
    writer = PrefixCache.for_model(model, store, prefix_config(), ChunkSealer(secret))
    expected = generate(model, [VICTIM], CONFIG).requests[0].token_ids
    generate(model, [VICTIM], CONFIG, prefix=writer)
    writer.close()
    return store, writer.keys(VICTIM, "exact")[1], expected


def assert_one_fault_then_healed(
    model: LoadedModel, store: KVStore, key: str, expected: list[int], secret: bytes | None,
    caplog: pytest.LogCaptureFixture,
) -> PrefixCache:
    """A reader gets identical output reusing chunk 0 only, logs one warning naming `key`, and its
    rewrite makes the next reader reuse both chunks."""
    reader = PrefixCache.for_model(model, store, prefix_config(), ChunkSealer(secret))
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        output = generate(model, [VICTIM], CONFIG, prefix=reader)
    reader.close()  # raises what the writer could not handle (a MemoryError, before)
    assert output.requests[0].token_ids == expected, "output differs from recomputation"
    assert output.stats.prefix_reused_tokens == CHUNK, "chunk 0 is intact and must be reused, chunk 1 refused"
    assert reader.fault_counts == {"StoredValueError": 1}, reader.fault_counts
    faults = [record.getMessage() for record in caplog.records if record.name == "kvlab.store"]
    assert len(faults) == 1 and key in faults[0] and "chunk 1 of 2" in faults[0], faults
    healed = PrefixCache.for_model(model, store, prefix_config(), ChunkSealer(secret))
    again = generate(model, [VICTIM], CONFIG, prefix=healed)
    assert again.stats.prefix_reused_tokens == 2 * CHUNK and not healed.fault_counts, "the value was not rewritten"
    assert again.requests[0].token_ids == expected
    return reader


@pytest.mark.parametrize("secret", MODES, ids=MODE_IDS)
def test_a_sparse_3_gib_value_is_refused_unread_and_rewritten(
    victim_model: LoadedModel, tmp_path: Path, secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    store, key, expected = filled(victim_model, f"file://{tmp_path / 'store'}", secret)
    path = tmp_path / "store" / key[:2] / key
    os.truncate(path, SPARSE_BYTES)
    assert_one_fault_then_healed(victim_model, store, key, expected, secret, caplog)
    assert path.stat().st_size < 1 << 20, "the sparse value must be replaced by the recomputed chunk"


def test_the_file_store_sizes_and_refuses_a_huge_value_without_reading_it(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    store.put("ab-1", b"x")
    os.truncate(tmp_path / "store" / "ab" / "ab-1", SPARSE_BYTES)
    tracemalloc.start()
    try:
        assert store.contains("ab-1") and store.nbytes("ab-1") == SPARSE_BYTES
        with pytest.raises(StoredValueError, match=f"has {SPARSE_BYTES} bytes, more than the 4096"):
            store.get("ab-1", max_bytes=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"sizing and refusing the value allocated {peak} bytes: it was read"


@pytest.mark.parametrize("secret", MODES, ids=MODE_IDS)
def test_a_huge_redis_value_is_refused_unread_and_rewritten(
    victim_model: LoadedModel, redis_url: str, secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    store, key, expected = filled(victim_model, redis_url, secret)
    with redis.Redis.from_url(redis_url) as raw:
        raw.setrange(NAMESPACE + key, 64 << 20, b"!")  # 64 MiB made by the server, never sent
    tracemalloc.start()
    try:
        with pytest.raises(StoredValueError, match="more than the 4096"):
            store.get(key, max_bytes=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"refusing the value allocated {peak} bytes: it was read"
    assert_one_fault_then_healed(victim_model, store, key, expected, secret, caplog)


@pytest.mark.parametrize("backend", ["redis", "redis+cluster"])
def test_a_redis_key_of_another_type_is_one_faulty_chunk_not_an_outage(
    victim_model: LoadedModel, backend: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(request.getfixturevalue("redis_url" if backend == "redis" else "redis_cluster_url"))
    store, key, expected = filled(victim_model, url, SECRET)
    store.delete(key)
    raw_client(request, backend).hset(NAMESPACE + key, "planted", "by an attacker")
    reader = assert_one_fault_then_healed(victim_model, store, key, expected, SECRET, caplog)
    # The store was never marked down: another prompt's fetch goes to it right away.
    other = generate(victim_model, [OTHER], CONFIG, prefix=reader)
    assert other.stats.prefix_fetches[0].failure != "store marked unreachable"
    assert raw_client(request, backend).type(NAMESPACE + key) == b"string", "the rewrite must repair the key"


def raw_client(request: pytest.FixtureRequest, backend: str) -> redis.Redis | redis.RedisCluster:
    if backend == "redis":
        return redis.Redis.from_url(str(request.getfixturevalue("redis_url")).split("?")[0])
    cluster: LocalRedisCluster = request.getfixturevalue("redis_cluster")
    return redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])


@pytest.mark.parametrize("backend", ["redis", "redis+cluster"])
def test_store_ls_and_verify_report_a_wrong_type_key_and_go_on(
    victim_model: LoadedModel, backend: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(request.getfixturevalue("redis_url" if backend == "redis" else "redis_cluster_url"))
    store, key, _ = filled(victim_model, url, None)
    raw_client(request, backend).rpush(NAMESPACE + "zz-planted-list", "x")
    assert main(["store", "ls", url, "--json"]) == 0
    rows = {row["key"]: row for row in json.loads(capsys.readouterr().out)["keys"]}
    assert rows["zz-planted-list"]["bytes"] is None and "holds a list" in rows["zz-planted-list"]["problem"]
    assert rows[key]["bytes"] > 0
    assert main(["store", "verify", url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["num_values"] == 3 and [entry["key"] for entry in report["failed"]] == ["zz-planted-list"]
    assert main(["store", "verify", url, "--delete"]) == 0
    assert "3 values checked, 1 failed; removed the 1 that failed" in capsys.readouterr().out
    expected_keys = PrefixCache.for_model(victim_model, store, prefix_config()).keys(VICTIM, "exact")
    assert sorted(store.keys()) == sorted(expected_keys)


def test_verify_delete_removes_each_bad_value_and_never_aborts(
    victim_model: LoadedModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"file://{tmp_path / 'store'}"
    store, key, _ = filled(victim_model, url, None)
    first = PrefixCache.for_model(victim_model, store, prefix_config()).keys(VICTIM, "exact")[0]
    os.truncate(tmp_path / "store" / key[:2] / key, 32 << 30)  # the 32 GiB that made verify abort
    store.put("zz-truncated", (store.get(first) or b"")[:-9])
    assert main(["store", "verify", url, "--delete", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(entry["key"] for entry in report["failed"]) == sorted([key, "zz-truncated"])
    oversized = next(entry for entry in report["failed"] if entry["key"] == key)
    assert oversized["bytes"] == 32 << 30 and "StoredValueError" in oversized["problem"]
    assert store.keys() == [first], "only the intact value stays"


@pytest.mark.parametrize("secret", MODES, ids=MODE_IDS)
def test_a_hard_linked_value_is_refused_and_rewritten(
    victim_model: LoadedModel, tmp_path: Path, secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    store, key, expected = filled(victim_model, f"file://{tmp_path / 'store'}", secret)
    path = tmp_path / "store" / key[:2] / key
    os.link(path, tmp_path / "attacker-handle")  # through it the attacker could rewrite the value in place
    with pytest.raises(StoredValueError, match="2 hard links"):
        store.get(key)
    assert_one_fault_then_healed(victim_model, store, key, expected, secret, caplog)
    assert path.stat().st_nlink == 1


def test_a_new_file_store_root_is_private_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        FileStore(tmp_path / "new" / "store")
    finally:
        os.umask(previous)
    assert (tmp_path / "new" / "store").stat().st_mode & 0o777 == 0o700


def test_one_broken_chunk_met_by_two_fetches_is_one_warning(
    victim_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """A background prefetch, then a lossless verifier's fetch of the exact resolutions: one fault."""
    planted = plant(victim_model, "truncated_value", SECRET)
    reader = PrefixCache.for_model(victim_model, planted.store, prefix_config(), planted.sealer)
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        first = reader.fetch(VICTIM)
        second = reader.fetch(VICTIM, exact_resolutions())
    assert first.num_tokens == second.num_tokens == CHUNK and second.stats.failed_key == planted.key
    faults = [record.getMessage() for record in caplog.records if record.name == "kvlab.store"]
    assert len(faults) == 1 and planted.key in faults[0], faults
    assert sum(reader.fault_counts.values()) == 1, reader.fault_counts


def test_kvlab_generate_over_a_sparse_32_gib_value_exits_0_and_heals_the_store(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It printed the right answer, then exited 1 with BackgroundWriteError (MemoryError) on every run."""
    monkeypatch.setenv("KVLAB_STORE_SECRET", SECRET.decode())
    prompt = " ".join(f"w{token}" for token in VICTIM)
    url = f"file://{tmp_path / 'store'}"
    argv = ["generate", "--model", str(tiny_model_dir), "--raw", "--prompt", prompt, "--max-new-tokens", "6",
            "--ignore-eos", "--json", "--prefix-store", url, "--prefix-chunk-tokens", str(CHUNK)]
    assert main(argv) == 0
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    values = sorted(path for path in (tmp_path / "store").rglob("*") if path.is_file())
    assert len(values) >= 2
    os.truncate(values[0], 32 << 30)
    for _ in range(2):
        code = main(argv)
        captured = capsys.readouterr()
        assert code == 0, captured.err[-2000:]
        assert json.loads(captured.out)["token_ids"] == expected
    assert values[0].stat().st_size < 1 << 20, "the oversized value must be rewritten by the first run"
