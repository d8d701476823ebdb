"""A missing client venv skips the client tests on a developer's machine and fails them under CI."""

from __future__ import annotations

import pytest

from tests.integration.test_clients.clients import client_venv


def test_a_missing_client_venv_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KVLAB_CLIENTS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="make clients-setup"):
        client_venv(".venv-absent-client")


@pytest.mark.parametrize("variable", ["CI", "KVLAB_CLIENTS"])
def test_a_missing_client_venv_fails_under_ci(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KVLAB_CLIENTS", raising=False)
    monkeypatch.setenv(variable, "true")
    with pytest.raises(pytest.fail.Exception, match="make clients-setup"):
        client_venv(".venv-absent-client")
