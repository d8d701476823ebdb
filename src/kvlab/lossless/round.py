"""One lossless round of one sequence, top to bottom: draft, verify, accept and roll back.

The same model drafts tokens from the compressed (draft) cache, one forward per token (or, with prompt
lookup, the round takes what followed the context's last tokens before: `kvlab.lossless.prompt_lookup`,
no forward at all); one forward
over the pending tokens and the drafts on the full cache verifies them. The longest run of drafts the
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
from kvlab.cache.tiers import request_loads
from kvlab.generation.feed import Feed, LayerKV, RoundHost, Rounds
from kvlab.generation.sampling import draw_tokens
from kvlab.lossless.acceptance import accept_drafts
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.draft_length import DraftLengthController
from kvlab.lossless.prompt_lookup import LookupChoice, find_continuation
from kvlab.lossless.remote_prefix import ExactPrefixInTransit
from kvlab.lossless.stats import LosslessStats


@dataclasses.dataclass(slots=True)
class LosslessState:
    """One lossless sequence's two caches and where its decoding stands between rounds.

    Attributes:
        full: The verifier's exact KV (one row), or the exact prefix still in transit (a remote-prefix
            start: it becomes the full cache before the first verify).
        draft: The drafter's compressed KV (one row).
        settings: The request's lossless settings (schedule, draft length, drafter).
        controller: Chooses this sequence's draft lengths.
        pending: Tokens known to be right that the full cache does not hold yet (the last emitted
            token; after a remote-prefix start, the rest of the prompt too).
        draft_missing: How many trailing `pending` tokens the draft cache lacks (fed to it
            provisionally, then replaced by their exact KV after the verify).
        draft_logits: [1, V] logits predicting the first draft token, when already computed.
        stats: This sequence's rounds.
        totals: Every sequence's rounds (the engine's figures); shared, not owned.
        lookup: Its prompt-lookup drafting, with what its rounds emitted (None without prompt lookup).
    """

    full: KVCache | ExactPrefixInTransit
    draft: KVCache
    settings: LosslessConfig
    controller: DraftLengthController
    pending: list[int]
    draft_missing: int
    totals: LosslessStats
    draft_logits: torch.Tensor | None = None
    stats: LosslessStats = dataclasses.field(default_factory=LosslessStats)
    lookup: LookupChoice | None = None

    def record_round(self, num_draft_tokens: int, num_accepted_tokens: int, looked_up: bool = False) -> None:
        self.totals.record_round(num_draft_tokens, num_accepted_tokens, looked_up)
        self.stats.record_round(num_draft_tokens, num_accepted_tokens, looked_up)
        if looked_up:
            assert self.lookup is not None
            self.lookup.update(num_accepted_tokens)
        else:
            self.controller.update(num_draft_tokens, num_accepted_tokens)


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
    looked_up = _lookup_proposal(host, state)
    if looked_up:
        draft_token_ids, draft_probs, num_fed = looked_up, None, 0
    else:
        in_transit = isinstance(state.full, ExactPrefixInTransit)
        controller = state.controller
        planned = controller.transit_num_draft_tokens() if in_transit else controller.next_num_draft_tokens()
        num_planned = max(min(planned, host.remaining() - 1), 0)
        draft_token_ids, draft_probs, num_fed = yield from _draft_from_cache(host, state, num_planned)

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
        # A looked-up draft was proposed with certainty: its distribution is one-hot.
        probs = torch.nn.functional.one_hot(draft_ids[0], vocab).float() if draft_probs is None else (
            torch.stack(draft_probs) if draft_probs else target_logits.new_empty(0, vocab))
        probs = probs[None]
    num_accepted, next_token = accept_drafts(draft_ids, probs, target_logits[None], host.config, host.generator)
    accepted = int(num_accepted[0])

    # Roll back: the full cache keeps the pending tokens and the accepted drafts; the draft cache drops
    # what it was fed this round and takes the same tokens' exact KV from the verify forward.
    state.full.drop_last(len(draft_token_ids) - accepted)
    state.draft.set_provisional(False)
    state.draft.drop_last(num_fed)
    begin, end = len(state.pending) - state.draft_missing, len(state.pending) + accepted
    state.draft.append([(keys[:, :, begin:end], values[:, :, begin:end]) for keys, values in captured], [end - begin])
    state.record_round(len(draft_token_ids), accepted, looked_up=bool(looked_up))
    state.pending, state.draft_missing = [int(next_token[0])], 1
    return draft_token_ids[:accepted] + state.pending


def _lookup_proposal(host: RoundHost, state: LosslessState) -> list[int]:
    """The prompt lookup's drafts for this round, when it has some and they are expected to pay more
    than drafting from the compressed cache (or standing aside); [] otherwise."""
    choice = state.lookup
    if choice is None or isinstance(state.full, ExactPrefixInTransit) or state.draft_logits is not None:
        return []
    if not state.controller.drafting_allowed():
        return []
    proposal = find_continuation(host.context_ids(), min(choice.lookup.num_draft_tokens, host.remaining() - 1),
                                 choice.lookup)
    cache_tokens_per_verify = state.controller.expected_rate() * state.controller.costs.verify_s
    return proposal if proposal and choice.takes_lookup(cache_tokens_per_verify) else []


def _draft_from_cache(
    host: RoundHost, state: LosslessState, num_planned: int
) -> Generator[Feed, torch.Tensor, tuple[list[int], list[torch.Tensor], int]]:
    """Draft `num_planned` tokens, one forward per token on the draft cache (the first also feeds the
    pending tokens it lacks); returns the drafts, their distributions (sampling) and the tokens fed."""
    draft_token_ids: list[int] = []
    draft_probs: list[torch.Tensor] = []
    num_fed = 0
    logits, state.draft_logits = state.draft_logits, None
    while True:
        if logits is not None and len(draft_token_ids) < num_planned:
            token, distribution = draw_tokens(logits, host.config, host.generator)
            draft_token_ids.append(int(token[0]))
            if distribution is not None:
                draft_probs.append(distribution[0])
        if len(draft_token_ids) >= num_planned or _prefix_landed(state, draft_token_ids):
            return draft_token_ids, draft_probs, num_fed
        missing = state.draft_missing if num_fed == 0 else 0
        feed = state.pending[len(state.pending) - missing :] if missing else [draft_token_ids[-1]]
        logits = yield Feed(state.draft, feed, drafting=True)
        num_fed += len(feed)


def _prefix_landed(state: LosslessState, draft_token_ids: list[int]) -> bool:
    """A remote-prefix start verifies as soon as its exact prefix has landed and one draft is in."""
    return isinstance(state.full, ExactPrefixInTransit) and state.full.landed() and bool(draft_token_ids)
