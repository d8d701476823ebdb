"""KV store for prefix reuse: content keys, byte-store backends by URL scheme, chunk authentication."""

from kvlab.store import file, memory, redis, redis_cluster
from kvlab.store.auth import ChunkAuthError, ChunkSealer, load_secret
from kvlab.store.base import (
    KVStore,
    StoredValueError,
    StoreUnavailableError,
    check_key,
    create_store,
    redact_url,
    stores,
)
from kvlab.store.keys import chunk_keys, fingerprint
from kvlab.store.prefix import PrefixCache, PrefixConfig, PrefixSource
from kvlab.store.verify import ValueCheck, check_value, verify_store

__all__ = [
    "ChunkAuthError",
    "ChunkSealer",
    "KVStore",
    "PrefixCache",
    "PrefixConfig",
    "PrefixSource",
    "StoreUnavailableError",
    "StoredValueError",
    "ValueCheck",
    "check_key",
    "check_value",
    "chunk_keys",
    "create_store",
    "file",
    "fingerprint",
    "load_secret",
    "memory",
    "redact_url",
    "redis",
    "redis_cluster",
    "stores",
    "verify_store",
]
