"""How kvlab's command asks the OpenMP runtime to wait (read once, when torch first loads it).

With the default (spinning) policy, a thread that reaches a barrier keeps its core busy until the
others arrive. When other processes compete for the cores, the spinning threads take the time
slices the late thread needs: a decode step measured here went from 111 ms to 1249 ms. Passive
waiting sleeps instead, so throughput degrades with the share of the cores the process gets, but
on an idle machine waking the sleeping threads costs (`benchmarks/under_load.py` measures both:
passive decoded 44% slower than spinning when alone, and 1.3-4.8x faster beside two competitors).
So the command waits passively when other work is already running when it starts, and leaves the
runtime's default otherwise; OMP_WAIT_POLICY in the environment always wins.
"""

from __future__ import annotations

import os
import sys

# One-minute load average from which other processes are taken to be competing for the cores.
BUSY_LOAD = 0.5


def choose_wait_policy(load: float, environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The OMP_WAIT_POLICY to set, or None to leave the environment as it is.

    Args:
        load: The machine's one-minute load average before kvlab starts working.
        environ: The process environment (a policy already chosen there is kept).
    """
    if "OMP_WAIT_POLICY" in environ:
        return None
    return "PASSIVE" if load >= BUSY_LOAD else None


def configure_wait_policy() -> bool:
    """Apply `choose_wait_policy` to this process; returns whether a policy was set in time (before
    torch, hence the OpenMP runtime, loaded)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    policy = choose_wait_policy(load, os.environ)
    if policy is None:
        return False
    os.environ["OMP_WAIT_POLICY"] = policy
    return "torch" not in sys.modules
