"""Drafters: where a lossless round's draft tokens come from, behind one interface.

Each round, every drafter of a sequence makes an `Offer`: how many tokens it could propose now and
what each costs (a draft forward on some weights over some cache, or nothing). The planner
(`kvlab.lossless.planner`) takes one offer, or none (a plain step), and a length; the round then
runs that drafter's `draft`, a coroutine of feeds like the round itself, and verifies what it returns.
The verify makes any proposal lossless, so a drafter is only ever a question of speed.

Registered drafters (`kvlab ls`): `compressed_cache` (the same model on the sequence's compressed
cache, with the served weights or a cheaper copy) and `prompt_lookup` (what followed the context's
last tokens before, at no forward). `--drafter ngram+<compressor>` composes the two: each round the
planner takes whichever offer is expected to pay more.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Generator
from typing import Any, ClassVar, Protocol

import torch

from kvlab.cache import KVCache
from kvlab.generation.feed import Feed, RoundHost
from kvlab.registry import Registry

drafters: Registry[Drafter] = Registry("drafter")


class RoundState(Protocol):
    """What a drafter reads and updates of a lossless sequence between rounds (`kvlab.lossless.round`)."""

    draft: KVCache
    full: Any  # the full cache, or a remote start's exact prefix still in transit
    pending: list[int]
    draft_missing: int
    draft_logits: torch.Tensor | None

    @property
    def in_transit(self) -> bool: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Offer:
    """What one drafter can propose this round, before any forward.

    Attributes:
        drafter: Who offers.
        max_tokens: The most tokens it can propose now.
        token_ids: The tokens, where they are known already (prompt lookup); None: drafted forward by forward.
        weights: The weights its draft forwards run on (`DRAFT_WEIGHTS`); None: its drafts cost no forward.
        num_cached: Tokens each of its draft forwards attends over (before the token it feeds).
        kind: Which of the drafter's proposals this is, where they are accepted at different rates (prompt
            lookup: the n of the n-gram it matched); offers of one kind share an acceptance record.
    """

    drafter: Drafter
    max_tokens: int
    token_ids: list[int] | None = None
    weights: str | None = None
    num_cached: int = 0
    kind: str = ""

    @property
    def acceptance_key(self) -> str:
        """The name of the acceptance record that judges this offer (the drafter's, per kind)."""
        return f"{self.drafter.name}/{self.kind}" if self.kind else self.drafter.name


@dataclasses.dataclass(slots=True)
class Proposal:
    """A round's draft tokens.

    Attributes:
        token_ids: The drafts, in order.
        probs: Each draft's [V] distribution (sampling from a forward); None: proposed with certainty.
        num_fed: Tokens fed to the draft cache while drafting (rolled back after the verify).
    """

    token_ids: list[int]
    probs: list[torch.Tensor] | None = None
    num_fed: int = 0


class Drafter(abc.ABC):
    """A source of draft tokens (see the module docstring).

    Attributes:
        prior_acceptance: What a draft of this source is expected to be accepted with, given the drafts
            before it were, before anything is measured (the planner's prior).
    """

    prior_acceptance: ClassVar[float] = 0.5

    @property
    def name(self) -> str:
        return str(type(self).registry_name)  # type: ignore[attr-defined]

    def prior_of(self, kind: str) -> float:
        """The planner's prior for its offers of `kind` (`Offer.kind`): `prior_acceptance` unless the drafter
        knows its kinds apart before any is measured."""
        return self.prior_acceptance

    @property
    def round_tokens(self) -> int | None:
        """The most tokens one of its rounds proposes, whatever it is asked (None: as many as asked)."""
        return None

    @abc.abstractmethod
    def offer(self, host: RoundHost, state: RoundState, limit: int) -> Offer | None:
        """What it can propose this round, at most `limit` tokens (None: nothing this round)."""

    @abc.abstractmethod
    def draft(
        self, host: RoundHost, state: RoundState, offer: Offer, num_tokens: int
    ) -> Generator[Feed, torch.Tensor, Proposal]:
        """Propose `num_tokens` (at most `offer.max_tokens`) tokens, yielding the draft forwards it needs."""
