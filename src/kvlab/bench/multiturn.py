"""Shared-context tasks: one document compressed once, at the first question, then reused turn after turn.

A conversation's turn k prompt is the document, the earlier questions with their reference answers,
then question k; so turn 1's prompt and turn k's share a token prefix that ends inside question 1.
The cache a deployment keeps is the one compressed at turn 1 and extended since. Each turn is run
as one generation, with two things that make it equal to that:
- a prefix store (`memory://`, one per cell) restores the tokens computed by earlier turns, so a
  turn only computes its new tokens, as a conversation over a stored prefix does;
- an eviction compressor is wrapped in `CompressedOnce`, which records the positions turn 1 kept
  and, at later turns, keeps those of them in the prefix shared with turn 1 plus every later token.
  Turn 1 runs without the store, so its compressor observes the queries of the whole prompt (a
  prefill restored in part computes queries for the rest only); turn 2 saves, later turns reuse.
  Quantizers (KIVI, TurboQuant) need no wrapper: they treat each token the
  same whatever follows it, so quantizing turn k's prompt stores what turn 1 stored plus the rest.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from kvlab.compress import CompressionContext, Compressor, EvictionCompressor, MergingCompressor
from kvlab.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CompressedOnce(EvictionCompressor):
    """`inner`'s selection made once, at turn 1, and replayed on the prefix later turns share with it.

    At turn 1 (`selections` empty for a layer) `inner` selects and the kept positions are recorded per
    layer. At a later turn the recorded positions below `num_tokens` (the prefix shared with turn 1,
    whose tokens and so keys are the same) are kept again, plus every token from `num_tokens` on.
    Not registered: it wraps another compressor and lives for one conversation of one cell.
    """

    inner: EvictionCompressor | None = None
    selections: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    num_tokens: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.inner is None or isinstance(self.inner, MergingCompressor):
            raise ConfigError("CompressedOnce wraps an eviction compressor (merging methods change kept values)")

    @property
    def observes_queries(self) -> bool:  # type: ignore[override]
        assert self.inner is not None
        return self.inner.observes_queries

    def num_kept(self, num_tokens: int) -> int:
        assert self.inner is not None
        return self.inner.num_kept(num_tokens)

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        raise AssertionError("CompressedOnce selects in select(); score() is never called")

    def select(
        self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext, num_kept: int
    ) -> torch.Tensor:
        assert self.inner is not None
        recorded = self.selections.get(context.layer_idx)
        if recorded is None:
            kept = self.inner.select(keys, values, context, num_kept)
            self.selections[context.layer_idx] = kept
            return kept
        shared = min(self.num_tokens or keys.shape[1], keys.shape[1])
        per_head = [head[head < shared] for head in recorded]
        if len({len(head) for head in per_head}) != 1:
            raise ValueError("turn 1 kept a different number of shared tokens per head; cannot replay it")
        tail = torch.arange(shared, keys.shape[1], device=keys.device).expand(len(per_head), -1)
        return torch.cat([torch.stack(per_head).to(keys.device), tail], dim=1)


def shared_prefix_length(first: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading token ids two prompts have in common."""
    length = 0
    for a, b in zip(first, other, strict=False):
        if a != b:
            break
        length += 1
    return length


def compressor_for_turn(
    compressor: Compressor | None,
    selections: dict[int, torch.Tensor],
    first_prompt: Sequence[int],
    prompt: Sequence[int],
) -> Compressor | None:
    """The compressor a turn runs with: eviction records (turn 1) or replays (later) its selection in `selections`."""
    if not isinstance(compressor, EvictionCompressor):
        return compressor
    if isinstance(compressor, MergingCompressor):
        logger.warning("%s merges values: each turn compresses its own prompt", compressor.registry_name)
        return compressor
    num_tokens = None if list(first_prompt) == list(prompt) else shared_prefix_length(first_prompt, prompt)
    return CompressedOnce(inner=compressor, selections=selections, num_tokens=num_tokens)
