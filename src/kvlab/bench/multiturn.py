"""Shared-context tasks: one document compressed once, at the first question, then reused turn after turn.

A conversation's turn k prompt is the document, the earlier questions with their reference answers,
then question k; so turn 1's prompt and turn k's share a token prefix that ends inside question 1.
The cache a deployment keeps is the one compressed at turn 1 and extended since. Each turn is run
as one generation, with two things that make it equal to that:
- a prefix store (`memory://`, one per cell) restores the tokens computed by earlier turns, so a
  turn only computes its new tokens, as a conversation over a stored prefix does;
- an eviction compressor is wrapped in `CompressedOnce`, which scores only the prefix shared with
  turn 1 (with that prefix's own last queries, i.e. question 1's) and keeps every later token: the
  selection turn 1 made. Quantizers (KIVI, TurboQuant) need no wrapper: they treat each token the
  same whatever follows it, so quantizing turn k's prompt stores what turn 1 stored plus the rest.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from kvlab.compress import CompressionContext, Compressor, EvictionCompressor, MergingCompressor
from kvlab.compress.eviction import ALWAYS_KEEP
from kvlab.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CompressedOnce(EvictionCompressor):
    """`inner` applied to the first `num_tokens` prompt tokens, as if the cache were compressed there.

    Tokens from `num_tokens` on are kept. Not registered: it wraps another compressor and lives only
    for one turn of a shared-context task.
    """

    inner: EvictionCompressor | None = None
    num_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.inner is None or isinstance(self.inner, MergingCompressor):
            raise ConfigError("CompressedOnce wraps an eviction compressor (merging methods change kept values)")
        if self.num_tokens < 1:
            raise ConfigError(f"num_tokens must be at least 1, got {self.num_tokens}")

    @property
    def observes_queries(self) -> bool:  # type: ignore[override]
        assert self.inner is not None
        return self.inner.observes_queries

    def num_kept(self, num_tokens: int) -> int:
        assert self.inner is not None
        shared = min(self.num_tokens, num_tokens)
        return self.inner.num_kept(shared) + num_tokens - shared

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        assert self.inner is not None
        shared = min(self.num_tokens, keys.shape[1])
        queries = None if context.queries is None else context.queries[:, :shared]
        scores = torch.full((keys.shape[0], keys.shape[1]), ALWAYS_KEEP, device=keys.device)
        scores[:, :shared] = self.inner.score(
            keys[:, :shared], values[:, :shared], CompressionContext(queries, context.scaling, context.layer_idx)
        )
        return scores


def shared_prefix_length(first: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading token ids two prompts have in common."""
    length = 0
    for a, b in zip(first, other):
        if a != b:
            break
        length += 1
    return length


def compressor_for_turn(compressor: Compressor | None, first_prompt: Sequence[int], prompt: Sequence[int]) -> Compressor | None:
    """The compressor a turn runs with: eviction wrapped to keep turn 1's selection, others unchanged."""
    if not isinstance(compressor, EvictionCompressor) or list(first_prompt) == list(prompt):
        return compressor
    if isinstance(compressor, MergingCompressor):
        logger.warning("%s merges values: each turn compresses its own prompt", compressor.registry_name)
        return compressor
    return CompressedOnce(inner=compressor, num_tokens=shared_prefix_length(first_prompt, prompt))

