"""Stored KV by layer: byte backends chosen by URL scheme (`backends`), the chunk format (`resolution`,
`auth`, `keys`, `verify`) and prefix reuse (`prefix`)."""

from kvlab.store.auth import ChunkAuthError, ChunkSealer, load_secret
from kvlab.store.backends import (
    KVStore,
    StoredValueError,
    StoreUnavailableError,
    check_key,
    create_store,
    file,
    memory,
    redact_url,
    redis,
    redis_cluster,
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
