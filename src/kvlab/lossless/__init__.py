"""Lossless speculative decoding from compressed KV caches (VeriCache): the acceptance rules, draft-length
control, one round (`round.py`) and the remote-prefix start. The engine (`kvlab.engine`) runs them."""

from kvlab.lossless.acceptance import greedy_accept, rejection_sample
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.draft_length import DraftLengthController, StepCosts
from kvlab.lossless.stats import LosslessOutput, LosslessStats

__all__ = [
    "DraftLengthController",
    "LosslessConfig",
    "LosslessOutput",
    "LosslessStats",
    "StepCosts",
    "greedy_accept",
    "rejection_sample",
]
