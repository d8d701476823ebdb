"""A sequence's decoding as a coroutine of feeds: what it asks the next forward for, and its logits back.

A decoding engine packs many sequences into one forward. Writing each sequence's decoding as a
generator keeps its logic in one readable function: it `yield`s a `Feed` (tokens to append to one of
its caches) and receives the logits of that feed's last `num_logits` positions, whatever else shared
the forward. Plain and lossy decoding (`plain_rounds`) feed one token per forward; lossless decoding
(`kvlab.lossless.round`) drafts on one cache and verifies on another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import Protocol

import torch

from kvlab.cache import KVCache, LayerKV
from kvlab.cache.tiers import request_loads
from kvlab.generation.config import GenerationConfig
from kvlab.generation.sampling import select_next_tokens


@dataclasses.dataclass(slots=True)
class Feed:
    """Tokens one sequence feeds the next forward.

    Attributes:
        cache: The one-row cache the tokens are appended to (their attention reads it).
        token_ids: The tokens, in order.
        drafting: The forward drafts (it runs on the drafter's weights; its cost counts as drafting).
        num_logits: Logits wanted for the last this-many tokens ([num_logits, V] is sent back).
        captured: When a list, each layer's new keys/values ([1, H_kv, q, D]) are appended to it.
    """

    cache: KVCache
    token_ids: list[int]
    drafting: bool = False
    num_logits: int = 1
    captured: LayerKV | None = None


Rounds = Generator[Feed, torch.Tensor, None]
"""A sequence's decoding: yields feeds, is sent each feed's [num_logits, V] logits, returns when it stops."""


class RoundHost(Protocol):
    """What a sequence's rounds need from the sequence that runs them."""

    @property
    def config(self) -> GenerationConfig: ...

    @property
    def generator(self) -> torch.Generator | None: ...

    def remaining(self) -> int:
        """Tokens the sequence may still generate."""
        ...

    def context_ids(self) -> list[int]:
        """The prompt and the tokens generated so far."""
        ...

    def emit(self, token_ids: list[int]) -> bool:
        """Record tokens the sequence generated; True while it goes on (no stop rule fired)."""
        ...


def plain_rounds(host: RoundHost, cache: KVCache, last_token: int) -> Rounds:
    """Decode one token per forward from `cache` (full, or compressed for lossy decoding), after the
    already emitted `last_token`, until the sequence stops; each token is chosen exactly as
    `kvlab.generation.reference_generate` chooses it."""
    token = last_token
    while True:
        request_loads(cache)
        logits = yield Feed(cache, [token])
        token = int(select_next_tokens(logits, host.config, host.generator)[0])
        if not host.emit([token]):
            return
