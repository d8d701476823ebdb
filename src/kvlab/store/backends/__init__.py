"""Byte stores chosen by URL scheme: the `KVStore` contract (`base`), memory, file, Redis and Redis
Cluster backends (each registers its schemes on import), and a throttled link (`link`) for experiments."""

from kvlab.store.backends import file, memory, redis, redis_cluster
from kvlab.store.backends.base import (
    KVStore,
    StoredValueError,
    StoreUnavailableError,
    check_key,
    create_store,
    redact_url,
    stores,
)

__all__ = [
    "KVStore",
    "StoreUnavailableError",
    "StoredValueError",
    "check_key",
    "create_store",
    "file",
    "memory",
    "redact_url",
    "redis",
    "redis_cluster",
    "stores",
]
