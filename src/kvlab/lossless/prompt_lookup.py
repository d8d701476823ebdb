"""Prompt-lookup drafts: the continuation of the longest recent n-gram match in the prompt and the output.

Code edits, summaries and answers over a document repeat long runs of their context; proposing what
followed the last n tokens where they occurred before costs no forward at all. Composed with a
compressed-cache drafter (`--drafter ngram+snapkv`), the planner takes the lookup's offer in a round
where it is expected to pay more than drafting from the compressed cache (or a plain step); both are
verified the same way, so the output stays the full model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import ClassVar

import numpy as np
import torch

from kvlab.errors import ConfigError
from kvlab.generation.feed import Feed, RoundHost
from kvlab.lossless.drafter import Drafter, Offer, Proposal, RoundState, drafters

NGRAM_PREFIX = "ngram+"


@drafters.register("prompt_lookup")
@dataclasses.dataclass(frozen=True, slots=True)
class PromptLookup(Drafter):
    """Drafts what followed the most recent earlier occurrence of the context's last n tokens (no forward).

    Attributes:
        max_ngram, min_ngram: Match the last n tokens for n from `max_ngram` down to `min_ngram`.
        num_draft_tokens: Tokens proposed per round at most.
    """

    prior_acceptance: ClassVar[float] = 0.5
    # Matches of `copying_ngram` tokens or more: the output is copying its context. Replaying SmolLM2's greedy
    # outputs with 4 drafts a step (docs/lookup-matches.json), 3-gram matches had 2.40 and 2.95 of 4 drafts
    # accepted a step (about 0.8 and 0.9 a draft), 1- and 2-gram matches 0.50 to 1.55 (0.35 to 0.6). With one
    # prior for both, a sequence whose compressed cache drafted well never tried its 8-gram matches (whose
    # drafts were then accepted at 0.94): the cache's learned rate beat the lookup's prior.
    copying_prior: ClassVar[float] = 0.8
    copying_ngram: ClassVar[int] = 3
    # Up to 8: the length of the match is what says whether the output is copying its context. Replaying
    # SmolLM2's greedy outputs with 8 drafts a step (docs/lookup-matches-8.json), 8-gram matches' first draft was
    # right in 6 of 6 steps on the 4K document and 8 of 8 on the 6.4K summary (5.83 and 6.75 drafts accepted a
    # step), 1-gram matches' in 4 of 11 and 4 of 19.
    max_ngram: int = dataclasses.field(default=8, metadata={"help": "longest n-gram matched"})
    min_ngram: int = dataclasses.field(default=1, metadata={"help": "shortest n-gram matched"})
    num_draft_tokens: int = dataclasses.field(default=8, metadata={"help": "tokens proposed per round at most"})

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                              f"{self.max_ngram}")
        if self.num_draft_tokens < 1:
            raise ConfigError(f"prompt lookup must propose at least 1 token, got {self.num_draft_tokens}")

    @property
    def round_tokens(self) -> int:
        return self.num_draft_tokens

    def prior_of(self, kind: str) -> float:
        """The prior of matches of `kind` (`LookupMatch.kind`, "<n>-gram")."""
        return self.prior_of_match(int(kind.partition("-")[0]))

    @classmethod
    def prior_of_match(cls, ngram: int) -> float:
        """The prior of a match of `ngram` tokens: `copying_prior` from `copying_ngram` up."""
        return cls.copying_prior if ngram >= cls.copying_ngram else cls.prior_acceptance

    def offer(self, host: RoundHost, state: RoundState, limit: int) -> Offer | None:
        """The continuation found now (none while a remote start's exact prefix is in transit, or where
        the draft cache already predicted the next token)."""
        if state.in_transit or state.draft_logits is not None:
            return None
        match = find_match(host.context_ids(), min(self.num_draft_tokens, limit), self)
        if not match.token_ids:
            return None
        # Judged per match length: a long match's continuation is accepted far more often than a 1-gram's.
        return Offer(self, len(match.token_ids), token_ids=match.token_ids, kind=match.kind)

    def draft(
        self, host: RoundHost, state: RoundState, offer: Offer, num_tokens: int
    ) -> Generator[Feed, torch.Tensor, Proposal]:
        assert offer.token_ids is not None
        yield from ()  # the tokens are known: no forward
        return Proposal(offer.token_ids[:num_tokens])


def split_drafter_name(name: str) -> tuple[PromptLookup | None, str]:
    """`ngram+snapkv` -> (prompt lookup, "snapkv"); a plain compressor name -> (None, name)."""
    if not name.startswith(NGRAM_PREFIX):
        return None, name
    compressor = name[len(NGRAM_PREFIX) :]
    if not compressor:
        raise ConfigError("name the compressed-cache drafter after 'ngram+', e.g. ngram+snapkv")
    return PromptLookup(), compressor


@dataclasses.dataclass(frozen=True, slots=True)
class LookupMatch:
    """A lookup's proposal and the length n of the n-gram it matched (0: no match, no tokens). A longer
    match is accepted far more often: on the greedy output of a 6.4K-token summary prompt (SmolLM2), the
    first token of an 8-gram match's continuation was right in 8 of 8 steps, of a 1- or 2-gram match's in 21%
    (`benchmarks/lookup_matches.py --num-draft-tokens 8`, docs/lookup-matches-8.json)."""

    token_ids: list[int]
    ngram: int

    @property
    def kind(self) -> str:
        """Its kind of offer (`kvlab.lossless.drafter.Offer.kind`): the matched n-gram's length."""
        return f"{self.ngram}-gram"


def find_match(context_ids: list[int] | np.ndarray, num_tokens: int, lookup: PromptLookup) -> LookupMatch:
    """What followed the most recent earlier occurrence of the context's last n tokens, for the largest n
    in `[lookup.min_ngram, lookup.max_ngram]` that occurs (at most `num_tokens` tokens, none where no n
    occurs), and that n (`context_ids` may be an int64 array: read in place).

    One pass over the context finds the earlier occurrences of its last token; each is then extended
    backwards, up to `max_ngram` tokens, over those candidates only. Scanning the whole context once per n
    cost 0.64-0.73 ms at 6.5K tokens where nothing matched (now 4-6 us; one process, quiet): a vLLM step of 8
    rows looks up every row."""
    tokens = np.asarray(context_ids, dtype=np.int64)
    length = len(tokens)
    if num_tokens < 1 or length < 2:
        return LookupMatch([], 0)
    # Ends of earlier occurrences, before the last token so that a match always has a continuation.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    if not len(ends):
        return LookupMatch([], 0)
    matched = np.ones(len(ends), dtype=np.int64)  # each occurrence's matched n-gram length, so far
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(lookup.max_ngram, length - 1)):
        before = ends - back
        alive &= before >= 0
        alive[alive] = tokens[before[alive]] == tokens[length - 1 - back]
        if not alive.any():
            break
        matched += alive
    size = int(matched.max())
    if size < lookup.min_ngram:
        return LookupMatch([], 0)
    start = int(ends[np.flatnonzero(matched >= size)[-1]]) + 1
    return LookupMatch(tokens[start : start + num_tokens].tolist(), size)
