"""StreamingLLM: attention sinks plus a recent window."""

from __future__ import annotations

import dataclasses

import torch

from kvlab.compress.base import MAX_TOKENS, CompressionContext, check_range, compressors
from kvlab.compress.eviction import EvictionCompressor, sinks_and_recent_scores


@compressors.register("streamingllm")
@dataclasses.dataclass
class StreamingLLMCompressor(EvictionCompressor):
    """StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

    Family: eviction. Keeps the first `num_sinks` tokens (attention sinks) and the most recent
    tokens up to the budget; needs no observation.

    Deviations from the paper:
    - The paper rolls the window at every decoding step; kvlab selects once on the prompt and keeps
      the tokens generated afterwards.
    - Positions are not re-indexed inside the cache: kvlab keeps each key's original rotary phase
      (the paper assigns cache-relative positions to extend past the training length).
    """

    num_sinks: int = dataclasses.field(default=4, metadata={"help": "initial tokens always kept"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("num_sinks", self.num_sinks, 0, MAX_TOKENS)

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        return sinks_and_recent_scores(keys, self.num_sinks)
