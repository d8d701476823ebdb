"""A sequence: everything about one request while the engine holds it."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvlab.cache import KVCache
from kvlab.engine.request import PrefilledPrompt, Request
from kvlab.generation.config import GenerationConfig
from kvlab.generation.feed import Feed, Rounds
from kvlab.generation.logprobs import TokenLogprobs, score_tokens
from kvlab.generation.prefill import PromptPrefill
from kvlab.generation.sampling import suppress_stop_tokens
from kvlab.generation.stopping import StopChecker, StopReason
from kvlab.lossless.round import LosslessState
from kvlab.lossless.stats import LosslessStats
from kvlab.store.prefix import FetchedPrefix


class Status(enum.Enum):
    """Where a sequence is: waiting (for admission, or for its prefix fetch), prefilling, running, finished."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(slots=True, eq=False)
class Sequence:
    """One request from `Engine.add_request` until its output is released.

    Attributes:
        id: The engine's id of the request.
        request: What was asked.
        generator: Its own seeded sampling generator (None when greedy).
        checker: Its stop rules.
        on_emit: Called with the tokens kept at each emission (the engine's streaming and figures).
        status: Where it is.
        token_ids: Generated so far.
        stop_reason: Why it stopped (None while it runs).
        error: What failed it, when something did (its stop reason is then "error", unless a stop rule
            had already ended it).
        fetch: Its prefix, being fetched in the background before prefill (None: fetched at prefill).
        prefilled: Its prompt's caches and last logits, when prefilled elsewhere (consumed at admission).
        prefill: Its prompt's prefill, piece by piece, while prefilling.
        cache: The cache decoding reads: full (plain, lossless) or compressed (lossy).
        lossless: The draft cache and round state (lossless requests).
        rounds: Its decoding once prefilled (see `kvlab.generation.feed`).
        feed: What the next forward feeds it.
        reused_tokens: Prompt tokens restored from a prefix store instead of computed.
        round_stats: Its lossless rounds, kept after its caches are freed (None: not lossless).
        primed: Its rounds have run up to their first feed.
        logprobs: Scores of its generated tokens (when its config asks for them).
        prompt_logprobs: Scores of its prompt tokens after the first (when its config asks for them).
        scored_logits: [n, V] raw logits of the last full-model forward it was fed, whose rows chose the
            next tokens it emits (what their scores come from).
    """

    id: int
    request: Request
    generator: torch.Generator | None
    checker: StopChecker
    on_emit: Callable[[Sequence, list[int]], None]
    status: Status = Status.WAITING
    token_ids: list[int] = dataclasses.field(default_factory=list)
    stop_reason: StopReason | None = None
    error: BaseException | None = None
    fetch: Future[FetchedPrefix] | None = None
    prefilled: PrefilledPrompt | None = None
    prefill: PromptPrefill | None = None
    cache: KVCache | None = None
    lossless: LosslessState | None = None
    rounds: Rounds | None = None
    feed: Feed | None = None
    reused_tokens: int = 0
    round_stats: LosslessStats | None = None
    primed: bool = False
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    scored_logits: torch.Tensor | None = None

    @property
    def config(self) -> GenerationConfig:
        return self.request.config

    @property
    def ready(self) -> bool:
        """Admissible: no prefix fetch is still on its way."""
        return self.fetch is None or self.fetch.done()

    @property
    def failure(self) -> str | None:
        """What failed it, as "<ExceptionType>: <message>" (None unless its stop reason is "error")."""
        if self.stop_reason != "error" or self.error is None:
            return None
        return f"{type(self.error).__name__}: {self.error}"

    @property
    def stored_cache(self) -> KVCache | None:
        """The cache its figures count: the draft cache of a lossless sequence, else the one decoding reads."""
        return self.lossless.draft if self.lossless is not None else self.cache

    def remaining(self) -> int:
        return self.checker.max_new_tokens - len(self.token_ids)

    def context_ids(self) -> list[int]:
        return self.request.prompt + self.token_ids

    def emit(self, token_ids: list[int]) -> bool:
        """Append `token_ids` one by one until a stop rule fires; True while the sequence goes on."""
        kept = len(token_ids)
        for count, token in enumerate(token_ids, start=1):
            self.token_ids.append(token)
            self.stop_reason = self.checker.check(self.token_ids)
            if self.stop_reason is not None:
                kept = count
                break
        if self.logprobs is not None and self.scored_logits is not None and kept:
            num_top = self.config.logprobs or 0
            self.logprobs.extend(score_tokens(self.scored_logits[:kept], token_ids[:kept], num_top))
        self.on_emit(self, token_ids[:kept])
        return self.stop_reason is None

    def choosing_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The [n, V] logits of a full-model forward whose row t chooses its next token number t, as
        its rounds must see them: kept for the tokens' scores, end tokens suppressed before `min_tokens`."""
        if self.logprobs is not None:
            self.scored_logits = logits
        return suppress_stop_tokens(logits, len(self.token_ids), self.config, self.checker.ending_token_ids)

    def advance(self, logits: torch.Tensor) -> None:
        """Hand the logits of its feed to its rounds and take their next feed (None once it stopped)."""
        assert self.rounds is not None and self.feed is not None
        if not self.feed.drafting:  # drafts may propose an end token: the verify then refuses it
            logits = self.choosing_logits(logits)
        try:
            self.feed = self.rounds.send(logits)
        except StopIteration:
            self.feed = None

    def start(self, rounds: Rounds | None) -> None:
        """Running from now on, with `rounds` to run from the next tick (None: it stopped on its first token)."""
        self.status = Status.RUNNING
        if self.lossless is not None:
            self.round_stats = self.lossless.stats
        self.prefill = None
        self.rounds = rounds

    def prime(self) -> None:
        """Run its rounds up to their first feed, at its first tick (a round starts when the tick does:
        a remote-prefix start decides then whether its exact prefix has landed)."""
        if self.rounds is not None and not self.primed:
            self.primed = True
            self.feed = next(self.rounds, None)

    def release_caches(self) -> None:
        self.prefill, self.prefilled, self.cache, self.lossless = None, None, None, None
        self.rounds, self.feed, self.fetch, self.scored_logits = None, None, None, None
