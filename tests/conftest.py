"""Shared fixtures: tiny random models (unit tests), the embedded real model (integration tests),
redis servers; the helpers they use are in `tests/helpers.py`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlab.models import LoadedModel
from tests.helpers import RedisServer, tiny_llama

# Every engine in the tests calibrates its cost model afresh: a calibration kept by an earlier test (or an
# earlier run on this machine) would change which rounds a planner chooses between runs of one test.
# Subprocesses (servers) inherit it; tests of the kept calibration set their own folder.
os.environ["KVLAB_CALIBRATION_DIR"] = ""

# Modules whose tests take seconds each (the architecture matrix builds and runs a model per family
# and capability); everything under tests/integration is slow too.
SLOW_MODULES = ("tests/unit/models/test_families.py",)
REDIS_FIXTURES = frozenset(
    {"redis_url", "redis_server", "redis_session_server", "redis_unix_url", "rediss_url", "redis_cluster_url"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests by where they live and what they use, so `-m "not slow"` and `-m "not redis"` select."""
    root = Path(str(config.rootpath))
    for item in items:
        path = Path(str(item.path)).relative_to(root).as_posix()
        if path.startswith("tests/integration/"):
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)
        elif path in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        callspec = getattr(item, "callspec", None)
        # Store tests pick their backend by a parameter and fetch the redis fixture only then.
        by_parameter = callspec is not None and any("redis" in str(value) for value in callspec.params.values())
        if by_parameter or REDIS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)


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
