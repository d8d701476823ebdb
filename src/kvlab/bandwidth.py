"""A token bucket: the one model of a bandwidth-limited link (store links, emulated KV tiers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvlab.errors import ConfigError


class TokenBucket:
    """`rate` tokens per second, at most `burst` saved up; `take(n)` blocks until n are available.

    Requests larger than the burst are served by going into debt, so a large transfer takes
    `n / rate` seconds instead of never starting.

    Args:
        rate: Tokens (bytes) per second.
        burst: Tokens that may be saved up while idle.
        clock: Seconds on a monotonic clock, read to refill the bucket.
        sleep: Waits the given seconds. Tests pass a fake `clock` and `sleep` pair, so the bucket's
            arithmetic is checked without waiting on the real clock.
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if rate <= 0 or burst <= 0:
            raise ConfigError(f"token bucket needs a positive rate and burst, got {rate} and {burst}")
        self.rate = rate
        self.burst = burst
        self._clock, self._sleep = clock, sleep
        self._tokens = burst
        self._stamp = clock()
        self._lock = threading.Lock()

    def take(self, amount: float) -> float:
        """Consume `amount` tokens, sleeping as long as the rate demands; returns the seconds slept."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= amount
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait
