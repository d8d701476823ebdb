"""The serving engine: one thread drives a `kvlab.engine.Engine` that requests join and leave between ticks.

HTTP handlers `submit` requests and `cancel` them from their own threads; both only touch queues under
a lock. The engine thread moves new requests into the engine, drops cancelled ones, runs one
`Engine.step` (admission, one prefill piece, one decoding tick) and sends each finished request its
last event. The engine interleaves prefill with decoding, so a long prompt never stalls the streams of
running requests for more than one piece.

Fetch-aware admission: with a prefix store, the engine fetches each request's prefix on background
workers and admits it once its KV has landed; requests with nothing to fetch are admitted meanwhile,
so a fetch overlaps the others' decoding and never blocks the head of the queue. A store that fails
costs the request its reuse, never its completion.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from kvlab.engine import Engine, EngineCallbacks, EngineConfig
from kvlab.errors import ConfigError, KvlabError
from kvlab.generation.outputs import RequestOutput
from kvlab.lossless.config import LosslessConfig
from kvlab.models import LoadedModel
from kvlab.serve.config import ServeConfig
from kvlab.serve.metrics import ServeMetrics
from kvlab.serve.prefixes import SaltedPrefixes
from kvlab.serve.request import FailedEvent, FinishedEvent, ServeRequest, TokensEvent
from kvlab.timing import timestamp_s

logger = logging.getLogger(__name__)

# Seconds pending prefix writes may take at shutdown beyond what is left of its timeout; a store slower
# than that loses them (they only save a later request its recomputation).
CLOSE_GRACE_S = 3.0
# How an engine request may stop and still be a normal finish; any other stop reason is a failure.
FINISH_REASONS = ("eos", "stop_string", "length")


class ServerBusyError(KvlabError):
    """The batch and the queue are full (HTTP 429)."""


class EngineClosedError(KvlabError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class ServeEngine:
    """Continuous batching over one model for a server (see the module docstring).

    Args:
        loaded: The model.
        config: Limits, prefill piece size and the prefix store.
        default_lossless: Settings lossless requests start from (drafter and draft length are per request).
        metrics: Updated as requests move through (a private set when None).
        on_failure: Called once if the engine thread itself fails (the server then exits non-zero).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: ServeConfig,
        default_lossless: LosslessConfig,
        metrics: ServeMetrics | None = None,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.default_lossless = default_lossless
        self.metrics = metrics or ServeMetrics(loaded.name, config.metrics_prefix)
        self.on_failure = on_failure
        self.failure: str | None = None
        self.prefixes = None
        if config.prefix_store is not None:
            self.prefixes = SaltedPrefixes(
                loaded, config.prefix_store, config.prefix_chunk_tokens, config.max_cache_salts
            )
        self._cond = threading.Condition()
        self._incoming: collections.deque[ServeRequest] = collections.deque()
        self._requests: dict[int, ServeRequest] = {}  # by engine id; read and written by the engine thread
        self._num_in_system = 0
        self._closing = False
        self._stopped = False
        callbacks = EngineCallbacks(
            on_tokens=self._on_tokens, on_prefill_started=self._on_prefill_started,
            on_prefill_piece=self._on_prefill_piece, on_fetched=self._wake,
        )
        engine_config = EngineConfig(config.max_num_seqs, interleave_prefill=True, aggregate_stats=False,
                                     fetch_workers=config.fetch_workers if self.prefixes is not None else 0)
        self.engine = Engine(loaded, engine_config, self.prefixes, callbacks)
        self._thread = threading.Thread(target=self._loop, name="kvlab-serve-engine", daemon=True)
        self._thread.start()

    # ----- called from other threads

    def submit(self, request: ServeRequest) -> None:
        """Queue `request`; its events go to `request.sink`.

        Raises:
            ServerBusyError: `max_num_seqs + max_queued_requests` requests are already in the system.
            EngineClosedError: The engine is shutting down, or has failed.
        """
        with self._cond:
            if self.failure is not None:
                raise EngineClosedError(f"the engine failed ({self.failure}); the server is stopping")
            if self._closing:
                raise EngineClosedError("the server is shutting down")
            if self._num_in_system >= self.config.max_num_seqs + self.config.max_queued_requests:
                raise ServerBusyError(
                    f"the server is at capacity ({self.config.max_num_seqs} running, "
                    f"{self.config.max_queued_requests} queued); retry later"
                )
            self._num_in_system += 1
            self._incoming.append(request)
            self.metrics.one_more_waiting()
            self._cond.notify()

    def cancel(self, request: ServeRequest) -> None:
        """Drop `request` at the engine's next tick (its client went away); no further events."""
        with self._cond:
            request.cancelled = True
            self._cond.notify()

    def shutdown(self, timeout_s: float = 0.0) -> None:
        """Take no new requests, let running and queued ones finish for up to `timeout_s`, end the rest
        with a `FailedEvent` (once the engine thread has finished its current tick), then finish
        pending prefix writes within what is left of `timeout_s` plus `CLOSE_GRACE_S` (past it they
        are dropped, with a warning)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline and self.num_in_system():
            time.sleep(0.02)
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()
        self._close_background(max(0.0, deadline - time.monotonic()) + CLOSE_GRACE_S)

    def _close_background(self, timeout_s: float) -> None:
        """Stop the fetch workers and finish pending prefix writes, waiting `timeout_s` at most: the
        writes run on a daemon thread, which a process that exits abandons."""

        def close() -> None:
            self.engine.close()
            if self.prefixes is not None:
                self.prefixes.close()

        closer = threading.Thread(target=close, name="kvlab-serve-close", daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():
            logger.warning("pending prefix writes did not finish within %.1f s of the shutdown; they are dropped",
                           timeout_s)

    @property
    def closing(self) -> bool:
        """Shutting down: no new requests are taken."""
        return self._closing

    @property
    def healthy(self) -> bool:
        """The engine has not failed and its thread runs (or ended in a requested shutdown)."""
        return self.failure is None and (self._thread.is_alive() or self._stopped)

    def num_in_system(self) -> int:
        with self._cond:
            return self._num_in_system

    # ----- the engine thread

    def _loop(self) -> None:
        try:
            while self._tick():
                pass
        except BaseException as error:  # a dead engine must fail its requests, not hang them
            logger.exception("the engine thread failed; failing every request and refusing new ones")
            self._die(f"{type(error).__name__}: {error}")

    def _tick(self) -> bool:
        """One round of the engine thread; False once stopped."""
        with self._cond:
            while not (self._incoming or self._stopped or self.engine.has_work() or self._any_cancelled()):
                self._cond.wait(timeout=None if not self.engine.num_fetching() else 0.05)
            incoming, self._incoming = list(self._incoming), collections.deque()
            stopped = self._stopped
        if stopped:
            self._fail_all("the server shut down before the request finished", incoming)
            return False
        for request in incoming:
            self._admit(request)
        self._drop_cancelled()
        self._update_gauges()
        if self.engine.has_work():
            self._deliver(self.engine.step())
            self._update_gauges()
        return True

    def _admit(self, request: ServeRequest) -> None:
        if request.cancelled:
            self._leave(request, "cancelled")
            return
        # Prefill pieces are the server's (a prefix store's chunks when it has one).
        pieces = None if self.prefixes is not None else self.config.prefill_chunk_tokens
        try:
            config = dataclasses.replace(request.request.config, prefill_chunk_tokens=pieces)
            request_id = self.engine.add_request(dataclasses.replace(request.request, config=config))
        except ConfigError as error:  # a setting the engine cannot honour: the client's to change
            self._leave(request, "invalid", FailedEvent(str(error), "invalid"))
            return
        except Exception as error:  # one request's failure is that request's alone
            logger.exception("admitting a request failed")
            self._leave(request, "error", FailedEvent(f"{type(error).__name__}: {error}"))
            return
        request.engine_id = request_id
        self._requests[request_id] = request

    def _drop_cancelled(self) -> None:
        for request_id, request in list(self._requests.items()):
            if request.cancelled:
                self.engine.cancel(request_id)
                self.engine.release(request_id)
                del self._requests[request_id]
                self._leave(request, "cancelled")

    def _deliver(self, finished_ids: list[int]) -> None:
        """Send each stopped request its last event and forget it: a failed one its `FailedEvent`,
        never a finish (whatever its stop reason says)."""
        for request_id in finished_ids:
            request = self._requests.pop(request_id, None)
            error = self.engine.error(request_id)
            output = self.engine.output(request_id)
            request_rounds = self.engine.round_stats(request_id)
            self.engine.release(request_id)
            if request is None:
                continue
            failure = _failed_event(request_id, error, output)
            if failure is not None:
                self._leave(request, failure.kind, failure)
                continue
            request.rounds = request_rounds
            stats = request.finish_stats(len(output.token_ids))
            if request.last_token_s is not None:
                self.metrics.e2e.observe(request.last_token_s - request.arrival_s)
            if request.rounds is not None:
                self.metrics.num_drafts.inc(request.rounds.num_drafting_rounds)
                self.metrics.num_draft_tokens.inc(request.rounds.num_draft_tokens)
                self.metrics.num_accepted_tokens.inc(request.rounds.num_accepted_tokens)
            self.metrics.finished("length" if output.stop_reason == "length" else "stop")
            self._leave(request, None, FinishedEvent(output, stats, request.last_token_ids))

    def _leave(
        self,
        request: ServeRequest,
        failure: str | None,
        event: FinishedEvent | FailedEvent | None = None,
    ) -> None:
        """`request` is out of the system: count it, then send its last event (none when cancelled)."""
        if failure is not None:
            self.metrics.failed(failure)
        with self._cond:
            self._num_in_system -= 1
        self._update_gauges()  # before the last event: a client that reads /metrics next sees it gone
        if event is not None:
            request.sink(event)

    def _fail_all(self, message: str, incoming: list[ServeRequest]) -> None:
        requests = [*incoming, *self._requests.values()]
        for request_id in list(self._requests):
            self.engine.cancel(request_id)
            self.engine.release(request_id)
        self._requests.clear()
        for request in requests:
            if request.cancelled:  # its client is gone: it is only counted out
                self._leave(request, None)
                continue
            request.cancelled = True
            self._leave(request, "error", FailedEvent(message, "shutdown"))

    def _die(self, reason: str) -> None:
        """Fail every request in the system and refuse new ones: the engine thread is gone."""
        with self._cond:
            self.failure = reason
            self._closing = True
            incoming, self._incoming = list(self._incoming), collections.deque()
        requests = [*incoming, *self._requests.values()]
        self._requests.clear()
        for request in requests:
            if not request.cancelled:
                request.cancelled = True
                self._leave(request, "error", FailedEvent(f"the engine failed: {reason}"))
        if self.on_failure is not None:
            self.on_failure()

    def _any_cancelled(self) -> bool:
        return any(request.cancelled for request in self._requests.values())

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # ----- engine callbacks (on the engine thread)

    def _on_prefill_started(self, request_id: int) -> None:
        request = self._requests[request_id]
        request.prefill_start_s = timestamp_s()
        request.cached_tokens = self.engine.reused_tokens(request_id)
        self.metrics.prompt_tokens.inc(len(request.request.prompt))
        self.metrics.prefix_fetched_tokens.inc(request.cached_tokens)
        self._update_gauges()  # it runs from its prefill on, before its first token reaches the client

    def _on_prefill_piece(self, request_id: int, num_tokens: int) -> None:
        self.metrics.prefix_recomputed_tokens.inc(num_tokens)

    def _on_tokens(self, request_id: int, tokens: list[int]) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        now = timestamp_s()
        if request.first_token_s is None:
            request.first_token_s = now
            self.metrics.ttft.observe(now - request.arrival_s)
        else:
            assert request.last_token_s is not None
            gap = (now - request.last_token_s) / len(tokens)
            for _ in tokens:
                self.metrics.itl.observe(gap)
        request.last_token_s = now
        request.num_tokens += len(tokens)
        self.metrics.generation_tokens.inc(len(tokens))
        sequence = self.engine.sequence(request_id)
        if sequence.stop_reason is not None:  # its last tokens: they travel with its FinishedEvent
            request.last_token_ids = list(tokens)
            return
        first = request.num_tokens == len(tokens)
        logprobs = None if sequence.logprobs is None else sequence.logprobs.tail(len(tokens))
        request.sink(TokensEvent(list(tokens), logprobs, sequence.prompt_logprobs if first else None))

    def _update_gauges(self) -> None:
        with self._cond:
            incoming = len(self._incoming)
        self.metrics.running.set(self.engine.num_running())
        self.metrics.set_waiting(engine=incoming + self.engine.num_unfinished() - self.engine.num_running())
        self.metrics.fetching.set(self.engine.num_fetching())
        fit = self.engine.planner.costs.fit
        self.metrics.cost_model_ticks.set(fit.num_ticks)
        self.metrics.cost_model_error.set(fit.mean_relative_error)


def _failed_event(request_id: int, error: BaseException | None, output: RequestOutput) -> FailedEvent | None:
    """The event of a request that stopped without finishing (None when it finished): "invalid" for a
    setting the engine could not honour, else "error" (logged here, with the traceback when there is one)."""
    if isinstance(error, ConfigError):  # a setting the engine cannot honour: the client's to change
        return FailedEvent(str(error), "invalid")
    if error is None and output.stop_reason in FINISH_REASONS:
        return None
    if error is not None:
        detail = f"{type(error).__name__}: {error}"
        logger.error("engine request %d failed: %s", request_id, detail, exc_info=error)
    else:  # the engine's own account (`RequestOutput.error`, "Type: message"), or its stop reason alone
        detail = output.error or f"it stopped as {output.stop_reason!r}"
        logger.error("engine request %d failed: %s", request_id, detail)
    return FailedEvent(str(detail))
