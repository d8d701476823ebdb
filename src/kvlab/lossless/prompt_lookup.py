"""Prompt-lookup drafts: the continuation of the longest recent n-gram match in the prompt and the output.

Code edits, summaries and answers over a document repeat long runs of their context; proposing what
followed the last n tokens where they occurred before costs no forward at all. Composed with a
compressed-cache drafter (`--drafter ngram+snapkv`), each round takes the lookup's proposal when it
is expected to pay more than drafting from the compressed cache, and drafts from the cache otherwise;
both are verified the same way, so the output stays the full model's. The choice is per sequence, from
the tokens each source's rounds emitted.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab.errors import ConfigError

NGRAM_PREFIX = "ngram+"


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLookup:
    """Settings of prompt-lookup drafting.

    Attributes:
        max_ngram, min_ngram: Match the last n tokens for n from `max_ngram` down to `min_ngram`.
        num_draft_tokens: Tokens proposed per round at most.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    num_draft_tokens: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ConfigError(f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {self.min_ngram}, "
                              f"{self.max_ngram}")
        if self.num_draft_tokens < 1:
            raise ConfigError(f"prompt lookup must propose at least 1 token, got {self.num_draft_tokens}")


def split_drafter_name(name: str) -> tuple[PromptLookup | None, str]:
    """`ngram+snapkv` -> (prompt lookup, "snapkv"); a plain compressor name -> (None, name)."""
    if not name.startswith(NGRAM_PREFIX):
        return None, name
    compressor = name[len(NGRAM_PREFIX) :]
    if not compressor:
        raise ConfigError("name the compressed-cache drafter after 'ngram+', e.g. ngram+snapkv")
    return PromptLookup(), compressor


def find_continuation(context_ids: list[int], num_tokens: int, lookup: PromptLookup) -> list[int]:
    """What followed the most recent earlier occurrence of the context's last n tokens, for the largest n
    in `[lookup.min_ngram, lookup.max_ngram]` that occurs; at most `num_tokens` tokens ([] when none)."""
    length = len(context_ids)
    if num_tokens < 1:
        return []
    tokens = torch.tensor(context_ids, dtype=torch.long)
    for size in range(min(lookup.max_ngram, length - 1), lookup.min_ngram - 1, -1):
        # Windows starting before the suffix itself, so a match always has a continuation.
        windows = tokens[: length - 1].unfold(0, size, 1)
        matches = (windows == tokens[length - size :]).all(dim=1).nonzero()
        if len(matches):
            start = int(matches[-1, 0]) + size
            return context_ids[start : start + num_tokens]
    return []


@dataclasses.dataclass(slots=True)
class LookupChoice:
    """One sequence's record of what each source's rounds emitted, to choose the next round's source.

    The lookup's drafts are free, so its rounds cost one verify; a compressed-cache round also costs its
    draft forwards. The lookup is taken while the tokens its rounds emit per verify beat the best rate
    the compressed-cache controller expects (in tokens per verify-equivalent), and tried first until
    its rounds were measured.

    Attributes:
        lookup: The settings.
        decay: Weight of history in the average.
        tokens_per_round: Average tokens a lookup round emitted (accepted drafts + 1); None until measured.
        num_rounds: Rounds that drafted from the lookup.
    """

    lookup: PromptLookup
    decay: float = 0.7
    tokens_per_round: float | None = None
    num_rounds: int = 0

    def takes_lookup(self, cache_tokens_per_verify: float) -> bool:
        """Whether a round whose lookup found a proposal should use it, given what a round drafting from
        the compressed cache is expected to emit per verify-equivalent of time."""
        return self.tokens_per_round is None or self.tokens_per_round >= cache_tokens_per_verify

    def update(self, num_accepted_tokens: int) -> None:
        emitted = num_accepted_tokens + 1.0
        old = self.tokens_per_round
        self.tokens_per_round = emitted if old is None else self.decay * old + (1 - self.decay) * emitted
        self.num_rounds += 1
