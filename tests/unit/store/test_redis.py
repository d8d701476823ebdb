"""The redis:// backend beyond the shared contract: URLs, namespace, raw bytes, unavailability."""

from __future__ import annotations

import shutil
from collections.abc import Callable
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
    for operation in (lambda: store.get("k"), lambda: store.put("k", b"v"), lambda: store.keys()):
        with pytest.raises(StoreUnavailableError, match=rf"redis://127.0.0.1:{port}/0.*redis-server --port {port}"):
            operation()
    store.close()


class FakeClock:
    """Seconds that pass only when a fake connection attempt times out or a retry backs off."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


CONNECT_ATTEMPTS = 2
"""A try and the one immediate retry RedisStore configures (`Retry(NoBackoff(), 1)`)."""


def test_a_silent_server_fails_each_operation_within_the_urls_timeout_per_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A host that never answers: every connection attempt waits out its whole timeout, on a fake clock.
    clock, timeouts = FakeClock(), []

    def connect_that_times_out(connection: redis.connection.Connection) -> None:
        timeouts.append(connection.socket_connect_timeout)
        clock.now += connection.socket_connect_timeout or float("inf")  # no timeout: it would wait forever
        raise TimeoutError("timed out")

    monkeypatch.setattr(redis.connection.Connection, "_connect", connect_that_times_out)
    monkeypatch.setattr(redis.retry, "sleep", clock.sleep)  # redis-py's backoff between retries
    store = create_store("redis://192.0.2.1:6379/0?timeout=0.5")  # TEST-NET-1: never routed
    operations: dict[str, Callable[[], object]] = {
        "get": lambda: store.get("k"), "put": lambda: store.put("k", b"v"), "keys": store.keys,
        "contains": lambda: store.contains("k"), "get_many": lambda: store.get_many(["a", "b"]),
    }
    for name, operation in operations.items():
        started, timeouts[:] = clock.now, []
        with pytest.raises(StoreUnavailableError, match=r"192\.0\.2\.1:6379.*Timeout connecting"):
            operation()
        assert timeouts and set(timeouts) == {0.5}, f"{name}: connect timeouts {timeouts}, not the URL's 0.5 s"
        assert clock.now - started <= CONNECT_ATTEMPTS * 0.5, (
            f"{name} gave up after {len(timeouts)} attempts ({clock.now - started} s): more than "
            f"{CONNECT_ATTEMPTS} of the URL's timeout")
    assert clock.slept == [], f"a server that is down must not be retried with backoff: slept {clock.slept}"
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
