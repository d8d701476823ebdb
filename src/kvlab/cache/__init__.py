"""The only code that builds and mutates KV caches."""

from kvlab.cache.kv_cache import FullKVLayer, KVCache, KVLayer
from kvlab.cache.step import ForwardStep, PackedStep, PairedPrefillStep, Segment, forward, run_packed, run_step

__all__ = [
    "ForwardStep",
    "FullKVLayer",
    "KVCache",
    "KVLayer",
    "PackedStep",
    "PairedPrefillStep",
    "Segment",
    "forward",
    "run_packed",
    "run_step",
]
