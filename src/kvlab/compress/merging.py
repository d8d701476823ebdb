"""Merging family: select tokens like eviction, then fold what is evicted into what is kept."""

from __future__ import annotations

import abc
import dataclasses

import torch

from kvlab.compress.base import CompressionContext
from kvlab.compress.eviction import EvictedKV, EvictionCompressor, gather_tokens


@dataclasses.dataclass
class MergingCompressor(EvictionCompressor):
    """Family base: `score()` selects the kept tokens, `merge_values()` rewrites values beforehand.

    Keys are kept as they are (so attention logits of kept tokens are unchanged); the values of kept
    tokens absorb the evicted ones by the method's rule.
    """

    @abc.abstractmethod
    def merge_values(
        self, values: torch.Tensor, kept_mask: torch.Tensor, context: CompressionContext, keys: torch.Tensor
    ) -> torch.Tensor:
        """[H_kv, T, D] values after merging evicted tokens (kept_mask [H_kv, T] False) into kept ones."""

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> EvictedKV:
        num_tokens = keys.shape[1]
        kept_indices = self.select(keys, values, context, self.num_kept(num_tokens))
        if kept_indices.shape[1] == num_tokens:
            return EvictedKV(keys, values, kept_indices)
        kept_mask = torch.zeros(keys.shape[0], num_tokens, dtype=torch.bool, device=keys.device)
        kept_mask.scatter_(1, kept_indices, True)
        merged = self.merge_values(values, kept_mask, context, keys)
        return EvictedKV(gather_tokens(keys, kept_indices), gather_tokens(merged, kept_indices), kept_indices)
