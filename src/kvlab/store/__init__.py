"""KV store for prefix reuse: content keys, byte-store backends by URL scheme."""

from kvlab.store import file, memory
from kvlab.store.base import KVStore, check_key, create_store, stores
from kvlab.store.keys import chunk_keys, fingerprint

__all__ = ["KVStore", "check_key", "chunk_keys", "create_store", "file", "fingerprint", "memory", "stores"]
