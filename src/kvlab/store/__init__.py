"""KV store for prefix reuse: content keys, byte-store backends by URL scheme."""

from kvlab.store import file, memory, redis
from kvlab.store.base import KVStore, StoreUnavailableError, check_key, create_store, stores
from kvlab.store.keys import chunk_keys, fingerprint

__all__ = [
    "KVStore",
    "StoreUnavailableError",
    "check_key",
    "chunk_keys",
    "create_store",
    "file",
    "fingerprint",
    "memory",
    "redis",
    "stores",
]
