"""The one place kvlab measures time: wall clock with device synchronization at both ends.

Accelerators run kernels asynchronously: a timestamp taken right after a call on CUDA (or MPS, XPU)
measures the launch, not the work. Every reading here first waits for the device's queued work.
"""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on `device` so a timestamp covers it (no-op on CPU and meta).

    Raises:
        ValueError: `device` is an accelerator type this torch build cannot synchronize.
    """
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)
    synchronize_backend = getattr(backend, "synchronize", None)
    if synchronize_backend is None:
        raise ValueError(f"cannot synchronize device {device}: torch has no {device.type}.synchronize")
    if device.index is None:
        synchronize_backend()
    else:
        synchronize_backend(device)


class Stopwatch:
    """Elapsed seconds since construction (or `restart`), synchronizing the device when read."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.restart()

    def restart(self) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()

    def elapsed(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self._start


def timestamp_s() -> float:
    """Seconds on the monotonic clock durations are measured on, for moments taken on different threads
    and subtracted later (a request's arrival and its tokens); it does not synchronize the device, so the
    caller reads it after the work it dates has completed (e.g. after the tokens were copied to the host)."""
    return time.perf_counter()
