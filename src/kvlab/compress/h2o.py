"""H2O: keep the heavy hitters of accumulated attention plus the recent tokens."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from kvlab.compress.base import CompressionContext, compressors
from kvlab.compress.eviction import ALWAYS_KEEP, EvictionCompressor, require_queries, window_attention_sum
from kvlab.errors import ConfigError


@compressors.register("h2o")
@dataclasses.dataclass
class H2OCompressor(EvictionCompressor):
    """H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference").

    Family: eviction. Each token's score is the attention it accumulated from every prompt query
    (causal); the budget is split into the most recent `recent_ratio` of it, always kept, and the
    highest-scoring ("heavy hitter") earlier tokens.

    Deviations from the paper:
    - The paper evicts greedily at every decoding step with a constant cache size; kvlab applies the
      heavy-hitter selection once to the prompt and keeps tokens generated afterwards, like the other
      eviction methods (generations are short next to the prompts benchmarked).
    - GQA: attention is averaged over the query heads of each KV head.
    """

    observes_queries: ClassVar[bool] = True
    observes_every_query: ClassVar[bool] = True

    recent_ratio: float = dataclasses.field(default=0.5, metadata={"help": "share of the budget for recent tokens"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.recent_ratio <= 1:
            raise ConfigError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        queries = require_queries(context, "h2o")
        scores = window_attention_sum(queries, keys, context.scaling)
        num_recent = int(self.num_kept(keys.shape[1]) * self.recent_ratio)
        if num_recent:
            scores[:, -num_recent:] = ALWAYS_KEEP
        return scores
