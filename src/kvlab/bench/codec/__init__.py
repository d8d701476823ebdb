"""Codec benchmarks on real KV: ratio, speed and error per codec, and rate against fidelity.

Lives in `bench/` because it needs a model and a cache to produce KV; the codecs themselves only
know tensors and bytes.
"""

from __future__ import annotations

from kvlab.bench.codec.harness import DEFAULT_CASES, BenchCase, CodecBenchStats, bench_codecs, collect_kv

__all__ = ["DEFAULT_CASES", "BenchCase", "CodecBenchStats", "bench_codecs", "collect_kv"]
