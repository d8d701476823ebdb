"""`memory://`: a process-local store, for tests and single-process experiments."""

from __future__ import annotations

import threading

from kvlab.store.backends.base import KVStore, check_bytes, check_key, check_prefix, check_size, stores


@stores.register("memory")
class MemoryStore(KVStore):
    """Keys and bytes in a dict guarded by a lock (safe across threads)."""

    url = "memory://"
    shared = False

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, create: bool = True) -> MemoryStore:
        return cls()

    def put(self, key: str, data: bytes) -> None:
        payload = check_bytes(data)
        with self._lock:
            self._data[check_key(key)] = payload

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        with self._lock:
            data = self._data.get(check_key(key))
        if data is not None:
            check_size(key, len(data), max_bytes, self.url)
        return data

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(check_key(key), None)

    def keys(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        with self._lock:
            return sorted(key for key in self._data if key.startswith(prefix))

    def nbytes(self, key: str) -> int | None:
        with self._lock:
            data = self._data.get(check_key(key))
        return None if data is None else len(data)
