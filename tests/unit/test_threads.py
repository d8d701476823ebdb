"""The CLI waits passively when other work already runs, and respects a policy the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

from kvlab.threads import BUSY_LOAD, choose_wait_policy


def test_a_busy_machine_gets_passive_waits_and_an_idle_one_the_default() -> None:
    assert choose_wait_policy(BUSY_LOAD + 1.0, {}) == "PASSIVE"
    assert choose_wait_policy(0.0, {}) is None


def test_a_policy_from_the_environment_is_kept() -> None:
    assert choose_wait_policy(5.0, {"OMP_WAIT_POLICY": "ACTIVE"}) is None
    env = dict(os.environ, OMP_WAIT_POLICY="ACTIVE")
    code = "import os; import kvlab.cli; print(os.environ['OMP_WAIT_POLICY'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "ACTIVE"


def test_the_cli_decides_before_torch_loads() -> None:
    """On a busy machine (load average patched), importing the command sets PASSIVE while torch is
    not loaded yet: the OpenMP runtime reads the policy once, when torch loads it."""
    code = """
import os, sys
os.getloadavg = lambda: (5.0, 5.0, 5.0)
import kvlab.threads as threads
decide = threads.configure_wait_policy
threads.configure_wait_policy = lambda: print("torch loaded before:", "torch" in sys.modules) or decide()
import kvlab.cli
print(os.environ["OMP_WAIT_POLICY"])
"""
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.split("\n")[:2] == ["torch loaded before: False", "PASSIVE"]
