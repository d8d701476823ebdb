"""The CLI asks for passive OpenMP waits before torch loads, and respects a policy the user chose."""

from __future__ import annotations

import os
import subprocess
import sys


def _policy_seen_by_the_cli(env: dict[str, str]) -> str:
    code = "import os, sys; import kvlab.cli; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_the_cli_sets_passive_waits_when_none_was_chosen() -> None:
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    assert _policy_seen_by_the_cli(env) == "PASSIVE True"


def test_a_policy_from_the_environment_is_kept() -> None:
    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE")
    assert _policy_seen_by_the_cli(env).startswith("ACTIVE")


def test_prefer_passive_waits_reports_whether_it_can_still_take_effect(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kvlab.threads import prefer_passive_waits

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert prefer_passive_waits() is False  # torch is loaded in the test process: too late
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert prefer_passive_waits() is False  # a chosen policy is left alone
