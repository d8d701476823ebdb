"""How kvlab's command asks the OpenMP runtime to wait (read once, when torch first loads it).

With the default (spinning) policy, a thread that reaches a barrier keeps its core busy until the
others arrive. On a machine where other processes compete for the cores, the spinning threads take
the time slices the late thread needs, and a decode step measured here went from 111 ms to 1249 ms.
Passive waiting sleeps instead, so throughput degrades with the share of the cores the process gets
(`benchmarks/under_load.py` measures both).
"""

from __future__ import annotations

import os
import sys


def prefer_passive_waits() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the environment chose a policy; returns whether it took
    effect (False once torch is loaded: the runtime has read its settings by then)."""
    if "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "torch" not in sys.modules
