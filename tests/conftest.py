"""Shared fixtures: tiny random models (unit tests), the embedded real model (integration tests),
redis servers; the helpers they use are in `tests/helpers.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlab.models import LoadedModel
from tests.helpers import (
    RedisServer,
    tiny_llama,
)


@pytest.fixture(params=[4, 2], ids=["mha", "gqa"])
def tiny_model(request: pytest.FixtureRequest) -> LoadedModel:
    return tiny_llama(num_kv_heads=request.param)


@pytest.fixture(scope="session")
def embedded_model() -> LoadedModel:
    from kvlab.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def redis_session_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_session_server: RedisServer) -> str:
    """URL of the shared test redis-server, emptied before each test so tests are independent."""
    redis_session_server.flush()
    return redis_session_server.url


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, which the test may stop."""
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()
