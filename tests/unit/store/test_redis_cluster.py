"""`redis+cluster://` beyond the store contract: URLs, keys spread over nodes, prefix reuse, a node killed mid-fetch."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlab.engine import generate
from kvlab.errors import ConfigError
from kvlab.generation.config import GenerationConfig
from kvlab.models import LoadedModel
from kvlab.store import KVStore, StoreUnavailableError, create_store
from kvlab.store.backends.redis import NAMESPACE
from kvlab.store.backends.redis_cluster import RedisClusterStore
from kvlab.store.prefix import PrefixCache, PrefixConfig
from tests.helpers import free_port, tiny_llama
from tests.unit.store.redis_cluster_nodes import LocalRedisCluster

CHUNK = 16
PROMPT = [(5 * i + 7) % 90 + 3 for i in range(75)]  # 4 complete chunks + 11 tokens
CONFIG = GenerationConfig(max_new_tokens=8, ignore_eos=True, prefill_chunk_tokens=CHUNK)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=5)


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[LocalRedisCluster]:
    """A cluster of the test's own, whose nodes the test may kill."""
    cluster = LocalRedisCluster(tmp_path / "cluster")
    yield cluster
    cluster.stop()


def prefix_cache(model: LoadedModel, store: KVStore | str) -> PrefixCache:
    # A tiny model recomputes faster than any store answers: pin fetching on (the planner is tested elsewhere).
    return PrefixCache.for_model(model, store, PrefixConfig(chunk_tokens=CHUNK, allow_recompute=False))


def test_url_names_every_start_node_and_masks_the_password() -> None:
    store = create_store("redis+cluster://:s%40cret@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002?timeout=0.5")
    assert isinstance(store, RedisClusterStore)
    assert store.nodes == [("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002)]
    assert store.url == "redis+cluster://***@10.0.0.1:7000,10.0.0.2:7001,[::1]:7002?timeout=0.5"
    assert store._connection["password"] == "s@cret" and store._connection["socket_timeout"] == 0.5


@pytest.mark.parametrize(("url", "message"), [
    ("redis+cluster://127.0.0.1:7000/0", "no database"),
    ("redis+cluster://127.0.0.1:7000?db=1", "unknown option 'db'"),
    ("redis+cluster://127.0.0.1:notaport", "host:port,host:port"),
    ("redis+cluster://127.0.0.1:7000,", "host:port,host:port"),
    ("redis+cluster://127.0.0.1:7000?timeout=-1", "positive number"),
])
def test_malformed_cluster_urls_are_config_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_store(url)


def test_an_unreachable_cluster_is_store_unavailable_from_the_first_operation() -> None:
    store = create_store(f"redis+cluster://127.0.0.1:{free_port()}?timeout=0.2")  # connecting is lazy
    with pytest.raises(StoreUnavailableError, match="redis cluster store .* is unavailable"):
        store.get("chunk")


def test_a_prefix_spreads_its_chunks_over_every_node(model: LoadedModel, redis_cluster: LocalRedisCluster,
                                                     redis_cluster_url: str) -> None:
    prefix = prefix_cache(model, redis_cluster_url)
    generate(model, [PROMPT * 2], CONFIG, prefix=prefix)
    prefix.flush()
    keys = prefix.store.keys()
    assert len(keys) == 9, keys
    assert {redis_cluster.node_of(NAMESPACE + key) for key in keys} == {0, 1, 2}


def test_prefix_reuse_through_a_cluster_is_identical(model: LoadedModel, redis_cluster_url: str) -> None:
    expected = generate(model, [PROMPT], CONFIG).requests[0].token_ids
    writer = prefix_cache(model, redis_cluster_url)
    generate(model, [PROMPT], CONFIG, prefix=writer)
    writer.close()
    output = generate(model, [PROMPT], CONFIG, prefix=prefix_cache(model, redis_cluster_url))
    assert output.requests[0].token_ids == expected
    assert output.stats.prefix_reused_tokens == 4 * CHUNK


class KillOnRead(KVStore):
    """Passes every call to `inner`, but kills the node owning a key just before the `fatal_read`-th read."""

    def __init__(self, inner: KVStore, cluster: LocalRedisCluster, fatal_read: int) -> None:
        self.inner, self.cluster, self.fatal_read, self.reads = inner, cluster, fatal_read, 0

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        self.reads += 1
        if self.reads == self.fatal_read:
            self.cluster.kill(self.cluster.node_of(NAMESPACE + key))
        return self.inner.get(key, max_bytes)

    def nbytes(self, key: str) -> int | None:
        return self.inner.nbytes(key)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def keys(self, prefix: str = "") -> list[str]:
        return self.inner.keys(prefix)


def test_a_node_killed_mid_fetch_is_recomputed_with_identical_output(
    model: LoadedModel, own_cluster: LocalRedisCluster, caplog: pytest.LogCaptureFixture
) -> None:
    expected = generate(model, [PROMPT], CONFIG).requests[0].token_ids
    store = create_store(own_cluster.url + "?timeout=0.5")
    writer = prefix_cache(model, store)
    generate(model, [PROMPT], CONFIG, prefix=writer)
    writer.flush()
    reader = prefix_cache(model, KillOnRead(store, own_cluster, fatal_read=3))
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        output = generate(model, [PROMPT], CONFIG, prefix=reader)
    assert output.requests[0].token_ids == expected
    assert output.stats.prefix_reused_tokens == 2 * CHUNK, "the two chunks read before the kill are reused"
    warnings = [record.getMessage() for record in caplog.records if record.name == "kvlab.store"]
    assert len(warnings) == 1 and "redis cluster store" in warnings[0], warnings
