"""Lossless speculative decoding from compressed KV caches (VeriCache)."""

from kvlab.lossless.acceptance import greedy_accept, rejection_sample
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.draft_length import DraftLengthController, StepCosts
from kvlab.lossless.engine import generate_lossless
from kvlab.lossless.run import LosslessRun
from kvlab.lossless.stats import LosslessOutput, LosslessStats

__all__ = [
    "DraftLengthController",
    "LosslessConfig",
    "LosslessOutput",
    "LosslessRun",
    "LosslessStats",
    "StepCosts",
    "generate_lossless",
    "greedy_accept",
    "rejection_sample",
]
