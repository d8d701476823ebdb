"""Store fixtures beyond the shared redis-server: one reached through a Unix socket, one through TLS, a cluster."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.store.redis_cluster_nodes import LocalRedisCluster
from tests.unit.store.servers import PrivateRedis


@pytest.fixture(scope="session")
def redis_unix_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path_factory.mktemp("redis-unix"), unix=True)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path_factory.mktemp("redis-tls"), tls=True)
    yield server
    server.stop()


@pytest.fixture
def redis_unix_url(redis_unix_server: PrivateRedis) -> str:
    """`redis+unix://` URL of a server listening only on a Unix socket, emptied before each test."""
    redis_unix_server.flush()
    return redis_unix_server.url


@pytest.fixture
def rediss_url(redis_tls_server: PrivateRedis) -> str:
    """`rediss://` URL (CA and client certificate) of a TLS-only server, emptied before each test."""
    redis_tls_server.flush()
    return redis_tls_server.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_url(redis_cluster: LocalRedisCluster) -> str:
    """`redis+cluster://` URL of a 3-node loopback cluster, emptied before each test."""
    redis_cluster.flush()
    return redis_cluster.url
