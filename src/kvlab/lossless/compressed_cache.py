"""The compressed-cache drafter: the same model, one forward per draft token on the sequence's compressed cache.

The drafts are the model's own greedy (or sampled) tokens as the compressed cache sees them; with
`draft_weights` other than `same` the draft forwards run a cheaper copy of the weights (bf16, int8,
int4). The first draft forward also feeds the pending tokens the draft cache lacks (the last round's
settled tokens), provisionally: the verify hands the draft cache their exact KV afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import ClassVar

import torch

from kvlab.generation.feed import Feed, RoundHost
from kvlab.generation.sampling import draw_tokens
from kvlab.lossless.drafter import Drafter, Offer, Proposal, RoundState, drafters
from kvlab.models.draft_weights import DraftWeights


@drafters.register("compressed_cache")
@dataclasses.dataclass(frozen=True, slots=True)
class CompressedCacheDrafter(Drafter):
    """Drafts with the model on the sequence's compressed cache (the compressor is `--drafter`'s).

    Attributes:
        draft_weights: The weights its forwards run: the served ones (same) or a bf16/int8/int4 copy.
    """

    prior_acceptance: ClassVar[float] = 0.8
    draft_weights: DraftWeights = dataclasses.field(
        default="same", metadata={"help": "weights the draft forwards run: same, bf16, int8 or int4"}
    )

    def offer(self, host: RoundHost, state: RoundState, limit: int) -> Offer | None:
        if limit < 1:
            return None
        return Offer(self, limit, weights=self.draft_weights, num_cached=state.draft.stored_tokens())

    def draft(
        self, host: RoundHost, state: RoundState, offer: Offer, num_tokens: int
    ) -> Generator[Feed, torch.Tensor, Proposal]:
        token_ids: list[int] = []
        probs: list[torch.Tensor] = []
        num_fed = 0
        logits, state.draft_logits = state.draft_logits, None
        while True:
            if logits is not None and len(token_ids) < num_tokens:
                token, distribution = draw_tokens(logits, host.config, host.generator)
                token_ids.append(int(token[0]))
                if distribution is not None:
                    probs.append(distribution[0])
            if len(token_ids) >= num_tokens or _prefix_landed(state, token_ids):
                return Proposal(token_ids, probs if not host.config.greedy else None, num_fed)
            missing = state.draft_missing if num_fed == 0 else 0
            feed = state.pending[len(state.pending) - missing :] if missing else [token_ids[-1]]
            logits = yield Feed(state.draft, feed, drafting=True)
            num_fed += len(feed)


def _prefix_landed(state: RoundState, token_ids: list[int]) -> bool:
    """A remote-prefix start verifies as soon as its exact prefix has landed and one draft is in."""
    return state.in_transit and state.full.landed() and bool(token_ids)  # type: ignore[union-attr]
