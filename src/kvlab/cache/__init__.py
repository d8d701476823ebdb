"""The only code that builds and mutates KV caches."""

from kvlab.cache.kv_cache import KVCache
from kvlab.cache.layers import FullKVLayer, KVLayer, LayerGeometry, LayerKV
from kvlab.cache.step import ForwardStep, PackedStep, PairedPrefillStep, Segment, forward, run_packed, run_step

__all__ = [
    "ForwardStep",
    "FullKVLayer",
    "KVCache",
    "KVLayer",
    "LayerGeometry",
    "LayerKV",
    "PackedStep",
    "PairedPrefillStep",
    "Segment",
    "forward",
    "run_packed",
    "run_step",
]
