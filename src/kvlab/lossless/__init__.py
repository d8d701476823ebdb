"""Lossless speculative decoding from compressed KV caches (VeriCache): the acceptance rules, the drafters,
the cost model and the round planner, one round (`round.py`) and the remote-prefix start. The engine
(`kvlab.engine`) runs them."""

from kvlab.lossless.acceptance import greedy_accept, rejection_sample
from kvlab.lossless.compressed_cache import CompressedCacheDrafter
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.cost_model import ForwardCostModel
from kvlab.lossless.drafter import Drafter, drafters
from kvlab.lossless.planner import RoundPlanner
from kvlab.lossless.prompt_lookup import PromptLookup
from kvlab.lossless.stats import LosslessOutput, LosslessStats

__all__ = [
    "CompressedCacheDrafter",
    "Drafter",
    "ForwardCostModel",
    "LosslessConfig",
    "LosslessOutput",
    "LosslessStats",
    "PromptLookup",
    "RoundPlanner",
    "drafters",
    "greedy_accept",
    "rejection_sample",
]
