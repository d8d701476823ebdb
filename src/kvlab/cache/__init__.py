"""The only code that builds and mutates KV caches."""

from kvlab.cache.kv_cache import FullKVLayer, KVCache, KVLayer
from kvlab.cache.step import ForwardStep, forward

__all__ = ["ForwardStep", "FullKVLayer", "KVCache", "KVLayer", "forward"]
