"""The one place kvlab measures time: wall clock with device synchronization at both ends."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued device work so a timestamp covers it (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
