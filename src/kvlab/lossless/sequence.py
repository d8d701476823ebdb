"""One request being decoded losslessly: its two caches and where its current round stands."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvlab.cache import KVCache
from kvlab.lossless.draft_length import DraftLengthController
from kvlab.lossless.stats import LosslessStats
from kvlab.store.prefix import FetchedPrefix


@dataclasses.dataclass(slots=True)
class Sequence:
    """A request's state between forwards.

    A round drafts `num_draft_tokens` tokens from the draft cache, one per forward, then verifies
    `pending + draft_token_ids` in one forward on the full cache. Rows of a batch keep their own
    rounds: each sequence drafts, verifies and rolls back on its own schedule.

    Attributes:
        request: Index of the request in the run.
        prompt: The prompt's token ids.
        full: The verifier's exact KV (one row); None while a remote prefix's exact KV is in transit.
        draft: The drafter's compressed KV (one row); None for a sequence that decodes without drafting
            (plain or lossy decoding in the same run: a round is then one forward on `full`, which is
            the compressed cache in lossy decoding).
        controller: Chooses this sequence's draft lengths.
        pending: Tokens known to be right that the full cache does not hold yet (the last emitted
            token; the rest of the prompt in a remote-prefix start).
        draft_missing: How many trailing `pending` tokens the draft cache lacks (they are fed to it
            provisionally and replaced by their exact KV after the verify).
        num_draft_tokens: This round's draft length.
        draft_token_ids: Tokens drafted so far this round.
        draft_probs: [V] float32 distribution each draft was sampled from (sampling only).
        draft_fed: Tokens fed to the draft cache this round (all provisional).
        draft_logits: [V] logits that predict the next draft token, when already computed.
        exact_prefix: The bit-exact prefix still in transit (remote-prefix start only).
        land_prefix: Builds `full` from the landed exact prefix before the first verify (remote start).
        stats: This sequence's own rounds (the run's `lossless_stats` adds up every sequence's).
    """

    request: int
    prompt: list[int]
    full: KVCache | None
    draft: KVCache | None
    controller: DraftLengthController
    pending: list[int]
    draft_missing: int
    num_draft_tokens: int = 0
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    draft_probs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    draft_fed: int = 0
    draft_logits: torch.Tensor | None = None
    exact_prefix: Future[FetchedPrefix] | None = None
    land_prefix: Callable[[], None] | None = None
    stats: LosslessStats = dataclasses.field(default_factory=LosslessStats)

    @property
    def ready_to_verify(self) -> bool:
        """Drafting is over: the round's drafts are in, or a remote prefix has landed after one draft."""
        if len(self.draft_token_ids) >= self.num_draft_tokens:
            return True
        return self.exact_prefix is not None and self.exact_prefix.done() and bool(self.draft_token_ids)

    def draft_feed(self) -> list[int]:
        """Tokens the next draft forward feeds: the pending tokens the draft lacks, then each draft."""
        if self.draft_fed == 0 and self.draft_missing > 0:
            return self.pending[len(self.pending) - self.draft_missing :]
        return [self.draft_token_ids[-1]]

    def verify_feed(self) -> list[int]:
        return self.pending + self.draft_token_ids
