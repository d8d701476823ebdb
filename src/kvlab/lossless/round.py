"""One lossless round of one sequence, top to bottom: draft, verify, accept and roll back.

The planner (`kvlab.lossless.planner`) picks the round's drafter and length, or a plain step; the drafter
proposes (the same model on the compressed cache, one forward per token, or prompt lookup, no forward:
`kvlab.lossless.drafter`); one forward over the pending tokens and the drafts on the full cache
verifies them. The longest run of drafts the
full model agrees with is accepted (greedy) or kept by rejection sampling, and the full model's own
next token follows. Both caches roll back to the accepted length, and the draft cache takes the exact
KV of the accepted tokens from the verify forward in place of its own provisional KV. So greedy output
is the full model's greedy output, and sampling follows the full model's distribution.

Each forward is a `yield` of a `Feed` (see `kvlab.generation.feed`): the engine packs the feeds of many
sequences into one forward and sends each its logits, so rounds of a batch run on their own schedules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

import torch

from kvlab.cache import KVCache
from kvlab.cache.tiers import TieredKVLayer, request_loads
from kvlab.generation.feed import Feed, LayerKV, RoundHost, Rounds
from kvlab.lossless.acceptance import accept_drafts
from kvlab.lossless.compressed_cache import CompressedCacheDrafter
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.cost_model import SegmentShape
from kvlab.lossless.drafter import Drafter, Proposal
from kvlab.lossless.lengths import Acceptance
from kvlab.lossless.planner import RoundPlan, RoundPlanner
from kvlab.lossless.remote_prefix import ExactPrefixInTransit
from kvlab.lossless.stats import LosslessStats


@dataclasses.dataclass(slots=True)
class LosslessState:
    """One lossless sequence's two caches and where its decoding stands between rounds.

    Attributes:
        full: The verifier's exact KV (one row), or the exact prefix still in transit (a remote-prefix
            start: it becomes the full cache before the first verify).
        draft: The drafter's compressed KV (one row).
        settings: The request's lossless settings (draft length, schedule, drafters).
        planner: The engine's round planner (shared, not owned).
        pending: Tokens known to be right that the full cache does not hold yet (the last emitted
            token; after a remote-prefix start, the rest of the prompt too).
        draft_missing: How many trailing `pending` tokens the draft cache lacks (fed to it
            provisionally, then replaced by their exact KV after the verify).
        totals: Every sequence's rounds (the engine's figures); shared, not owned.
        draft_logits: [1, V] logits predicting the first draft token, when already computed.
        drafters: Its drafters (prompt lookup before the compressed cache, which comes last).
        acceptance: Its acceptance per kind of offer (`Offer.acceptance_key`), per draft position; the
            planner makes each record on first use.
        stats: This sequence's rounds.
    """

    full: KVCache | ExactPrefixInTransit
    draft: KVCache
    settings: LosslessConfig
    planner: RoundPlanner
    pending: list[int]
    draft_missing: int
    totals: LosslessStats
    draft_logits: torch.Tensor | None = None
    drafters: list[Drafter] = dataclasses.field(default_factory=list)
    acceptance: dict[str, Acceptance] = dataclasses.field(default_factory=dict)
    stats: LosslessStats = dataclasses.field(default_factory=LosslessStats)

    def __post_init__(self) -> None:
        self.drafters = self.drafters or drafters_of(self.settings)

    @property
    def in_transit(self) -> bool:
        """A remote-prefix start whose exact prefix has not been verified against yet."""
        return isinstance(self.full, ExactPrefixInTransit)

    def full_shape(self, num_tokens: int) -> SegmentShape:
        """The full cache's segment when it is fed `num_tokens` (what a plain step or a verify reads)."""
        assert isinstance(self.full, KVCache)
        # What its loads move over the link (a float32 cache moves twice `nbytes`, whose fp16 convention
        # priced the link at half its cost and the rounds too short: 4K, batch 4, 2 GB/s, k 3.8 for 8).
        tier_bytes = sum(layer.load_bytes(0) for layer in self.full.layers if isinstance(layer, TieredKVLayer))
        return SegmentShape(num_tokens, self.full.seq_lengths[0], tier_bytes)

    def record_round(self, plan: RoundPlan, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        looked_up = plan.source == "prompt_lookup"
        self.totals.record_round(num_draft_tokens, num_accepted_tokens, looked_up)
        self.stats.record_round(num_draft_tokens, num_accepted_tokens, looked_up)
        self.planner.round_done(self, plan, num_draft_tokens, num_accepted_tokens)


def drafters_of(settings: LosslessConfig) -> list[Drafter]:
    """The drafters a sequence's planner chooses from each round: prompt lookup (with `ngram+`), then the
    compressed cache."""
    cache = CompressedCacheDrafter(settings.draft_weights)
    return [cache] if settings.prompt_lookup is None else [settings.prompt_lookup, cache]


def lossless_rounds(host: RoundHost, state: LosslessState) -> Rounds:
    """Rounds until the sequence stops (its first token, if any, was emitted at admission)."""
    while True:
        tokens = yield from lossless_round(host, state)
        if not host.emit(tokens):
            return


def lossless_round(host: RoundHost, state: LosslessState) -> Generator[Feed, torch.Tensor, list[int]]:
    """One round; returns the tokens it settled (accepted drafts, then the full model's next token)."""
    # Draft-cache tokens stay provisional until the verify settles them.
    state.draft.set_provisional(True)
    if state.settings.schedule == "staggered" and isinstance(state.full, KVCache):
        request_loads(state.full)  # the full KV's load overlaps the drafting
    plan = state.planner.plan(host, state)
    proposal = Proposal([])
    if plan.offer is not None:
        proposal = yield from plan.offer.drafter.draft(host, state, plan.offer, plan.num_draft_tokens)
    state.draft_logits = None  # they predicted this round's first draft only
    draft_token_ids = proposal.token_ids

    # Verify: the pending tokens and the drafts in one forward on the full cache.
    if isinstance(state.full, ExactPrefixInTransit):
        state.full, state.pending = state.full.land()
    if state.settings.schedule == "synchronous":
        request_loads(state.full)
    captured: LayerKV = []
    verify = Feed(state.full, state.pending + draft_token_ids, num_logits=len(draft_token_ids) + 1, captured=captured)
    target_logits = yield verify

    # Accept: the drafts the full model agrees with, then its own next token.
    draft_ids = torch.tensor([draft_token_ids], dtype=torch.long, device=target_logits.device)
    probs = None
    if not host.config.greedy:
        vocab = target_logits.shape[-1]
        # A draft proposed with certainty (prompt lookup) has a one-hot distribution.
        probs = torch.nn.functional.one_hot(draft_ids[0], vocab).float() if proposal.probs is None else (
            torch.stack(proposal.probs) if proposal.probs else target_logits.new_empty(0, vocab))
        probs = probs[None]
    num_accepted, next_token = accept_drafts(draft_ids, probs, target_logits[None], host.config, host.generator)
    accepted = int(num_accepted[0])

    # Roll back: the full cache keeps the pending tokens and the accepted drafts; the draft cache drops
    # what it was fed this round and takes the same tokens' exact KV from the verify forward.
    state.full.drop_last(len(draft_token_ids) - accepted)
    state.draft.set_provisional(False)
    state.draft.drop_last(proposal.num_fed)
    begin, end = len(state.pending) - state.draft_missing, len(state.pending) + accepted
    state.draft.append([(keys[:, :, begin:end], values[:, :, begin:end]) for keys, values in captured], [end - begin])
    state.record_round(plan, len(draft_token_ids), accepted)
    state.pending, state.draft_missing = [int(next_token[0])], 1
    return draft_token_ids[:accepted] + state.pending
