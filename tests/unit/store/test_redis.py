"""The redis:// backend beyond the shared contract: URLs, namespace, raw bytes, unavailability."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import redis

from kvlab.errors import ConfigError
from kvlab.store import StoreUnavailableError, create_store
from kvlab.store.backends.redis import NAMESPACE, RedisStore
from tests.helpers import RedisServer, free_port


def test_values_are_raw_bytes_under_the_namespace(redis_url: str) -> None:
    store = create_store(redis_url)
    payload = bytes(range(256))
    store.put("chunk-1", payload)
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.get(NAMESPACE + "chunk-1") == payload, "the value must be stored as-is, not pickled"
    store.close()


def test_keys_ignores_entries_outside_the_namespace(redis_url: str) -> None:
    store = create_store(redis_url)
    store.put("mine", b"1")
    with redis.Redis.from_url(redis_url) as raw:
        raw.set("other-app:key", b"2")
        raw.set("mine-too-but-not-namespaced", b"3")
        raw.set(NAMESPACE + "bad key", b"4")
    assert store.keys() == ["mine"]
    store.close()


def test_url_options_are_parsed() -> None:
    store = create_store("redis://:secret@example.invalid:6390/3?timeout=0.25")
    assert isinstance(store, RedisStore)
    kwargs = store._pool.connection_kwargs
    assert (store.host, store.port, kwargs["db"], kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (
        "example.invalid", 6390, 3, 0.25, 0.25)
    assert "secret" not in store.url, "the password must not appear in error messages"
    defaults = create_store("redis://")
    assert isinstance(defaults, RedisStore)
    assert (defaults.host, defaults.port, defaults._pool.connection_kwargs["socket_timeout"]) == (
        "localhost", 6379, 5.0
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://localhost:6379/zero", "database number"),
        ("redis://localhost:99999/0", "invalid port"),
        ("redis://localhost/0?timeout=0", "timeout must be a positive number"),
        ("redis://localhost/0?timeout=soon", "timeout must be a positive number"),
        ("redis://localhost/0?pool=3", "unknown option 'pool'"),
    ],
)
def test_bad_redis_urls_are_config_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_store(url)


def test_a_port_without_a_server_is_store_unavailable() -> None:
    port = free_port()
    store = create_store(f"redis://127.0.0.1:{port}/0?timeout=0.5")
    started = time.monotonic()
    for operation in (lambda: store.get("k"), lambda: store.put("k", b"v"), lambda: store.keys()):
        with pytest.raises(StoreUnavailableError, match=rf"redis://127.0.0.1:{port}/0.*redis-server --port {port}"):
            operation()
    assert time.monotonic() - started < 5, "an unreachable server must fail fast with a short timeout"
    store.close()


def test_a_server_that_dies_makes_the_next_operation_store_unavailable(redis_server: RedisServer) -> None:
    store = create_store(redis_server.url + "?timeout=0.5")
    store.put("before", b"stored")
    assert store.get("before") == b"stored"
    redis_server.stop()
    with pytest.raises(StoreUnavailableError, match="is redis-server running"):
        store.get("before")
    store.close()


def test_the_fixture_fails_rather_than_skips_without_redis_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="redis-server is not on PATH"):
        RedisServer(tmp_path)
