"""Fixtures of the client tests: the client venvs (session scope, so a missing one skips before any server
starts), the model directory the clients tokenize with, and the `kvlab serve` processes they drive."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_clients.clients import client_venv
from tests.integration.test_serve.server import ServeProcess


@pytest.fixture(scope="session")
def lmeval_venv() -> Path:
    return client_venv(".venv-lmeval")


@pytest.fixture(scope="session")
def guidellm_venv() -> Path:
    return client_venv(".venv-guidellm")


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    return client_venv(".venv-vllm")


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The embedded SmolLM2 in transformers format (tokenizer and float32 weights): what the server loads."""
    from kvlab.integrations.vllm.model import model_directory

    return model_directory()


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """`kvlab serve` with its default settings, as a user starts it."""
    process = ServeProcess(tmp_path_factory.mktemp("clients-serve"), "--max-num-seqs", "8")
    yield process
    process.stop()
