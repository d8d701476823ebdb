"""CaM: merge each evicted token's value into the tokens that follow it."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import torch

from kvlab.compress.base import MAX_SEED, MAX_TOKENS, CompressionContext, check_range, compressors
from kvlab.compress.eviction import require_queries, sinks_and_recent_scores, window_attention_sum
from kvlab.compress.merging import MergingCompressor


@compressors.register("cam")
@dataclasses.dataclass
class CaMCompressor(MergingCompressor):
    """CaM (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference").

    Family: merging. Tokens leave the cache oldest first, as in a window of `num_sinks` attention
    sinks plus the most recent tokens. When token e leaves, it is merged with probability
    p_e = min(1, A_e / mean(A_kept)), where A is the attention a token receives from the observation
    window and A_kept averages it over the tokens that stay: its value, divided by `merge_span`, is
    added to the values of the next `merge_span` tokens (which may themselves leave later and carry
    it further). Keys are never changed.

    Budget: `budget` or `compression_ratio` of the prompt, sinks and recent window included.

    Deviations from the paper:
    - Merging happens once over the prompt (the paper merges as each decoding step evicts); tokens
      generated afterwards are kept.
    - A is measured from the last `window_size` prompt queries (the paper's code averages over all
      queries seen so far); GQA averages the query heads of each KV head.
    - `sampling="expected"` replaces the Bernoulli draw by its expectation p_e, a deterministic
      variant; the default draws with a generator seeded by `seed` and the layer index.
    """

    observes_queries: ClassVar[bool] = True

    num_sinks: int = dataclasses.field(default=4, metadata={"help": "initial tokens always kept"})
    merge_span: int = dataclasses.field(default=32, metadata={"help": "tokens an evicted value is spread over"})
    window_size: int = dataclasses.field(default=32, metadata={"help": "observation window for attention"})
    sampling: Literal["bernoulli", "expected"] = dataclasses.field(
        default="bernoulli", metadata={"help": "merge decision: Bernoulli draw or its expectation"}
    )
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the Bernoulli draws"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("merge_span", "window_size"):
            check_range(name, getattr(self, name), 1, MAX_TOKENS)
        check_range("num_sinks", self.num_sinks, 0, MAX_TOKENS)
        # The Bernoulli generator is seeded with seed * 100_003 + layer, which must stay a 64-bit integer.
        check_range("seed", self.seed, 0, MAX_SEED)

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        return sinks_and_recent_scores(keys, self.num_sinks)

    def merge_values(
        self, values: torch.Tensor, kept_mask: torch.Tensor, context: CompressionContext, keys: torch.Tensor
    ) -> torch.Tensor:
        queries = require_queries(context, "cam")
        window = min(self.window_size, keys.shape[1])
        attention = window_attention_sum(queries[:, -window:], keys, context.scaling) / window
        kept_attention = (attention * kept_mask).sum(dim=1) / kept_mask.sum(dim=1)
        probabilities = (attention / kept_attention[:, None].clamp_min(1e-12)).clamp(0.0, 1.0)
        if self.sampling == "expected":
            weights = probabilities
        else:
            # Uniforms drawn on the host and copied over (no device read, and any device, meta included,
            # gets the same draws for the same seed).
            generator = torch.Generator().manual_seed(self.seed * 100_003 + context.layer_idx)
            uniforms = torch.rand(probabilities.shape, generator=generator, dtype=torch.float32)
            weights = (uniforms.to(probabilities.device) < probabilities).to(probabilities.dtype)
        return merge_forward(values, kept_mask, weights, self.merge_span)


def merge_forward(values: torch.Tensor, kept_mask: torch.Tensor, weights: torch.Tensor, span: int) -> torch.Tensor:
    """Fold evicted values, oldest first, into the `span` tokens after each.

    Args:
        values: [H, T, D].
        kept_mask: [H, T] bool, True for tokens that stay.
        weights: [H, T] merge weight of each token when it leaves (0 drops it, 1 merges it fully).
        span: Number of following tokens that share an evicted value.

    Returns:
        [H, T, D] float32 values; entries of evicted tokens are meaningless afterwards.
    """
    merged = values.float().clone()
    num_tokens = values.shape[1]
    leaving = weights * ~kept_mask
    for position in _merge_positions(kept_mask):
        share = merged[:, position] * leaving[:, position, None] / span
        merged[:, position + 1 : min(num_tokens, position + 1 + span)] += share[:, None]
    return merged.to(values.dtype)


def _merge_positions(kept_mask: torch.Tensor) -> range | list[int]:
    """Positions to fold, in order. Each fold reads values earlier folds changed, so the loop is
    sequential. On the CPU only positions some head evicts are visited; elsewhere listing them would be
    a device-to-host read, so every position is visited (a kept one folds a zero share: same result)."""
    if kept_mask.device.type == "cpu":
        return (~kept_mask).any(dim=0).nonzero().flatten().tolist()
    return range(kept_mask.shape[1])
