"""SnapKV: keep what the last prompt queries attend to."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from kvlab.compress.base import MAX_KERNEL_SIZE, MAX_TOKENS, CompressionContext, check_range, compressors
from kvlab.compress.eviction import ALWAYS_KEEP, EvictionCompressor, require_queries, window_attention_sum
from kvlab.errors import ConfigError


@compressors.register("snapkv")
@dataclasses.dataclass
class SnapKVCompressor(EvictionCompressor):
    """SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

    Family: eviction. The last `window_size` prompt tokens form the observation window: their
    attention over the earlier tokens, summed over the window and smoothed by 1-D pooling, scores each
    token; the top tokens fill the budget beside the window, which is always kept.

    Budget: `budget` (or the prompt minus `compression_ratio`) counts the window too.

    Deviations from the paper:
    - GQA: attention is averaged over the query heads of each KV head, so each KV head keeps one set
      (the paper's code repeats KV heads and selects per query head).
    - Tokens generated after the prompt are all kept (as in the paper, which compresses the prompt
      once).
    """

    observes_queries: ClassVar[bool] = True

    window_size: int = dataclasses.field(default=32, metadata={"help": "observation window (last prompt tokens)"})
    kernel_size: int = dataclasses.field(default=7, metadata={"help": "pooling kernel over token scores (odd)"})
    pooling: Literal["max", "avg"] = dataclasses.field(default="max", metadata={"help": "pooling of scores"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("window_size", self.window_size, 1, MAX_TOKENS)
        if not 1 <= self.kernel_size <= MAX_KERNEL_SIZE or self.kernel_size % 2 == 0:
            raise ConfigError(f"kernel_size must be an odd number in 1..{MAX_KERNEL_SIZE}, got {self.kernel_size}")

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        queries = require_queries(context, "snapkv")
        window = min(self.window_size, keys.shape[1])
        attention = window_attention_sum(queries[:, -window:], keys, context.scaling)
        # Eq. (2) of the paper: pool the prefix's scores (the window is kept whatever it scores).
        prefix = attention[:, None, : keys.shape[1] - window]
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        scores = torch.full_like(attention, ALWAYS_KEEP)
        if prefix.shape[-1]:
            padding = self.kernel_size // 2
            scores[:, : prefix.shape[-1]] = pool(prefix, self.kernel_size, stride=1, padding=padding)[:, 0]
        return scores
