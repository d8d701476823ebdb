"""A token bucket: the one model of a bandwidth-limited link (store links, emulated KV tiers)."""

from __future__ import annotations

import threading
import time

from kvlab.errors import ConfigError


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; `take(n)` blocks until n are available.

    Requests larger than the burst are served by going into debt, so a large transfer takes
    `n / rate` seconds instead of never starting.
    """

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ConfigError(f"token bucket needs a positive rate and burst, got {rate} and {burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._stamp = time.perf_counter()
        self._lock = threading.Lock()

    def take(self, amount: float) -> float:
        """Consume `amount` tokens, sleeping as long as the rate demands; returns the seconds slept."""
        with self._lock:
            now = time.perf_counter()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= amount
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait
