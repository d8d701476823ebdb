"""A request as the serving engine sees it, and the events it sends back to the HTTP side."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from kvlab.engine import Request
from kvlab.generation.logprobs import TokenLogprobs
from kvlab.generation.outputs import RequestOutput
from kvlab.lossless.stats import LosslessStats
from kvlab.serve.config import Mode
from kvlab.timing import timestamp_s


@dataclasses.dataclass(slots=True)
class TokensEvent:
    """New tokens of the request (several at once when a lossless round accepted drafts); its last
    tokens come with its `FinishedEvent` instead, so a stream can end on them.

    Attributes:
        token_ids: The tokens.
        logprobs: Their scores, when the request asked for them.
        prompt_logprobs: The prompt's scores, on the first event of a request that asked for them.
    """

    token_ids: list[int]
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None


@dataclasses.dataclass(slots=True)
class FinishedEvent:
    """The request stopped; `output.text` is its final text (cut at a stop string).

    Attributes:
        output: Everything it produced (`output.logprobs` and `output.prompt_logprobs` included).
        stats: Its figures.
        last_token_ids: Its last tokens, not sent in a `TokensEvent` (empty when it produced none since).
    """

    output: RequestOutput
    stats: RequestStats
    last_token_ids: list[int] = dataclasses.field(default_factory=list)


FailureKind = Literal["invalid", "shutdown", "error"]


@dataclasses.dataclass(slots=True)
class FailedEvent:
    """The request could not be completed (`message` is safe to show the client).

    Attributes:
        kind: "invalid": the request asked for what cannot be done (HTTP 400); "shutdown": the server's
            shutdown cut it (503); "error": it failed in the engine (500, logged there).
    """

    message: str
    kind: FailureKind = "error"


Event = TokensEvent | FinishedEvent | FailedEvent
EventSink = Callable[[Event], None]
"""Receives a request's events; called from the engine's thread, so it must be thread-safe."""


@dataclasses.dataclass(slots=True)
class RequestStats:
    """Per-request figures returned in the reply's `kvlab` field.

    Attributes:
        mode: plain, lossy or lossless.
        drafter: The compressor's name (lossy and lossless), else None.
        prompt_tokens, completion_tokens: Token counts.
        cached_tokens: Prompt tokens restored from the prefix store instead of computed.
        queue_s: Seconds from arrival until the request's prefill started (prefix fetch included).
        ttft_s: Seconds from arrival to the first token.
        decode_s: Seconds from the first token to the last.
        num_draft_tokens, num_accepted_tokens, rounds, acceptance_length: Lossless rounds (vLLM's
            definitions: acceptance length counts the bonus token); zero in other modes.
        num_plain_rounds: Lossless rounds that drafted nothing (the sequence stood aside, the engine's
            planner expected a plain step to pay more, or one token was left).
    """

    mode: Mode
    drafter: str | None
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    rounds: int = 0
    num_plain_rounds: int = 0
    acceptance_length: float = 0.0

    def record_rounds(self, rounds: LosslessStats) -> None:
        self.num_draft_tokens = rounds.num_draft_tokens
        self.num_accepted_tokens = rounds.num_accepted_tokens
        self.rounds = rounds.rounds
        self.num_plain_rounds = rounds.num_plain_rounds
        self.acceptance_length = rounds.acceptance_length

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True, eq=False)
class ServeRequest:
    """One request from arrival to its last event.

    Attributes:
        request: What the engine decodes: prompt, settings, mode, drafter, cache salt.
        sink: Where its events go.
        arrival_s: `kvlab.timing.timestamp_s()` at arrival.
        engine_id: Its id in the engine, once admitted to it.
        cancelled: The client went away; the engine drops the request at its next tick.
        cached_tokens: Prompt tokens restored from the prefix store.
        rounds: The lossless sequence's own round statistics, once it decodes.
        prefill_start_s, first_token_s, last_token_s: `kvlab.timing.timestamp_s()` at those moments.
        num_tokens: Tokens sent so far.
        last_token_ids: Its last tokens, held for its `FinishedEvent`.
    """

    request: Request
    sink: EventSink
    arrival_s: float = dataclasses.field(default_factory=timestamp_s)
    engine_id: int | None = None
    cancelled: bool = False
    cached_tokens: int = 0
    rounds: LosslessStats | None = None
    prefill_start_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    last_token_ids: list[int] = dataclasses.field(default_factory=list)

    def finish_stats(self, completion_tokens: int) -> RequestStats:
        """The reply's figures once the request has stopped."""
        request = self.request
        stats = RequestStats(
            request.mode, request.drafter_name, len(request.prompt), completion_tokens, self.cached_tokens
        )
        if self.prefill_start_s is not None:
            stats.queue_s = self.prefill_start_s - self.arrival_s
        if self.first_token_s is not None and self.last_token_s is not None:
            stats.ttft_s = self.first_token_s - self.arrival_s
            stats.decode_s = self.last_token_s - self.first_token_s
        if self.rounds is not None:
            stats.record_rounds(self.rounds)
        return stats
