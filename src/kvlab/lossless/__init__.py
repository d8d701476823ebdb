"""Lossless speculative decoding from compressed KV caches (VeriCache)."""

from kvlab.spec.acceptance import greedy_accept, rejection_sample
from kvlab.spec.draft_length import DraftLengthController
from kvlab.spec.engine import SpecConfig, generate_lossless
from kvlab.spec.stats import SpecStats

__all__ = [
    "DraftLengthController",
    "SpecConfig",
    "SpecStats",
    "generate_lossless",
    "greedy_accept",
    "rejection_sample",
]
