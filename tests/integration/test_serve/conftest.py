"""One `kvlab serve` process with default settings for the API and page tests of this package."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.integration.test_serve.server import ServeProcess


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    process = ServeProcess(tmp_path_factory.mktemp("serve"), "--max-num-seqs", "8")
    yield process
    process.stop()


@pytest.fixture(scope="package")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
