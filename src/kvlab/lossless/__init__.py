"""Lossless speculative decoding from compressed KV caches (VeriCache)."""

from kvlab.lossless.acceptance import greedy_accept, rejection_sample
from kvlab.lossless.draft_length import DraftLengthController
from kvlab.lossless.engine import SpecConfig, generate_lossless
from kvlab.lossless.stats import SpecStats

__all__ = [
    "DraftLengthController",
    "SpecConfig",
    "SpecStats",
    "generate_lossless",
    "greedy_accept",
    "rejection_sample",
]
