"""An emulated network link in front of a store: a token bucket limits bytes per second.

For experiments on one machine: wrapping a local store in `ThrottledStore(store, 1e9)` makes every
transfer take as long as it would over a 1 Gbit/s link. Reads and writes share the bucket, as they
share a real link.
"""

from __future__ import annotations

import time

from kvlab.bandwidth import TokenBucket
from kvlab.store.backends.base import KVStore


class ThrottledStore(KVStore):
    """`inner` behind a link of `bits_per_s` bandwidth and `latency_s` per request.

    Attributes:
        bytes_read: Bytes delivered by `get`, for measurements.
        bytes_written: Bytes accepted by `put`.
    """

    def __init__(self, inner: KVStore, bits_per_s: float, latency_s: float = 0.0, burst_bytes: int = 64 * 1024) -> None:
        self.inner = inner
        self.url, self.shared = inner.url, inner.shared
        self.bits_per_s = bits_per_s
        self.latency_s = latency_s
        self.bucket = TokenBucket(bits_per_s / 8, burst_bytes)
        self.bytes_read = 0
        self.bytes_written = 0

    def _transfer(self, size: int) -> None:
        if self.latency_s:
            time.sleep(self.latency_s)
        self.bucket.take(size)

    def put(self, key: str, data: bytes) -> None:
        self._transfer(len(data))
        self.bytes_written += len(data)
        self.inner.put(key, data)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        data = self.inner.get(key, max_bytes)
        self._transfer(len(data) if data is not None else 0)
        self.bytes_read += len(data) if data is not None else 0
        return data

    def contains(self, key: str) -> bool:
        self._transfer(0)
        return self.inner.contains(key)

    def delete(self, key: str) -> None:
        self._transfer(0)
        self.inner.delete(key)

    def nbytes(self, key: str) -> int | None:
        self._transfer(0)
        return self.inner.nbytes(key)

    def keys(self, prefix: str = "") -> list[str]:
        return self.inner.keys(prefix)

    def close(self) -> None:
        self.inner.close()
