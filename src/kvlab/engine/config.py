"""How an engine schedules, and where it reports progress."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine schedules.

    Attributes:
        max_num_seqs: Sequences prefilling or decoding at once (None: every request at once).
        interleave_prefill: Prefill one piece per tick so running streams keep flowing (a server), or
            every admitted prompt before decoding (offline batches).
        fetch_workers: Fetch each request's prefix on this many background threads before admitting
            it (0: the prefill fetches inline).
        aggregate_stats: Add every request's rounds and prefix fetches up in `Engine.lossless_stats`
            and `Engine.stats` (an offline batch); False for a long-lived engine (a server), which
            reads each request's own figures instead and must not grow with every request served.
    """

    max_num_seqs: int | None = None
    interleave_prefill: bool = False
    fetch_workers: int = 0
    aggregate_stats: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class EngineCallbacks:
    """Where the engine reports progress (each may be None). All run on the engine's thread except
    `on_fetched`, which a fetch worker calls.

    Attributes:
        on_tokens: (request id, tokens) as a request's tokens are emitted, for streaming.
        on_progress: Tokens emitted, for progress bars.
        on_prefill_started: (request id) when its prefill starts (its restored prefix is known then).
        on_prefill_piece: (request id, tokens) before each prefill piece is computed.
        on_fetched: A background prefix fetch finished: a request may be admissible now.
    """

    on_tokens: Callable[[int, list[int]], None] | None = None
    on_progress: Callable[[int], None] | None = None
    on_prefill_started: Callable[[int], None] | None = None
    on_prefill_piece: Callable[[int, int], None] | None = None
    on_fetched: Callable[[], None] | None = None
