"""The serving engine: one thread runs a continuous batch that requests join and leave between ticks.

Each loop iteration of the engine thread:
1. admits ready requests while the batch has room (`max_num_seqs` prefilling or decoding);
2. drops cancelled requests (their caches go with them);
3. prefills one piece of the oldest prefilling request (`prefill_chunk_tokens`), so a long prompt
   never stalls the streams of running requests for more than one piece;
4. runs one tick of the `LosslessRun`, which packs every running request into one forward: lossless
   requests draft and verify on their own schedule, plain and lossy ones take one token per tick.

Fetch-aware admission: with a prefix store, a new request first goes to a fetch worker, which looks
its prefix up and fetches it; only then is it ready. Requests with nothing to fetch, or whose fetch
has landed, are admitted meanwhile, so a fetch overlaps the others' decoding and never blocks the
head of the queue. A store that fails costs the request its reuse, never its completion.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvlab.errors import KvlabError
from kvlab.generation.config import GenerationConfig
from kvlab.generation.prefill import PromptPrefill
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.engine import EXACT, admit_prefilled
from kvlab.lossless.run import LosslessRun
from kvlab.lossless.stats import LosslessStats
from kvlab.models import LoadedModel
from kvlab.serve.config import ServeConfig
from kvlab.serve.metrics import ServeMetrics
from kvlab.serve.prefixes import SaltedPrefixes
from kvlab.serve.request import FailedEvent, FinishedEvent, ServeRequest, TokensEvent

logger = logging.getLogger(__name__)

# Aggregate round statistics of the run grow per round; the engine reads per-sequence ones, so the
# run's are reset past this many rounds (bounded memory in a long-lived server).
MAX_RUN_ROUNDS = 1 << 16
# An idle run that has seen this many requests is replaced, dropping its per-request slots.
MAX_RUN_REQUESTS = 1 << 12


class ServerBusyError(KvlabError):
    """The batch and the queue are full (HTTP 429)."""


class EngineClosedError(KvlabError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class ServeEngine:
    """Continuous batching over one model (see the module docstring).

    Args:
        loaded: The model.
        config: Limits, prefill piece size, draft weights and the prefix store.
        metrics: Updated as requests move through (a private set when None).
        on_failure: Called once if the engine thread itself fails (the server then exits non-zero).
        default_lossless: Settings lossless requests start from (drafter and draft length are per request).
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
        self.on_failure = on_failure
        self.failure: str | None = None
        self.config = config
        self.default_lossless = default_lossless
        self.metrics = metrics or ServeMetrics(loaded.name)
        self.prefixes = None
        if config.prefix_store is not None:
            self.prefixes = SaltedPrefixes(loaded, config.prefix_store, config.prefix_chunk_tokens, config.max_cache_salts)
        self.run = self._new_run()
        self._cond = threading.Condition()
        self._fetching: set[ServeRequest] = set()
        self._ready: collections.deque[ServeRequest] = collections.deque()
        self._prefilling: collections.deque[tuple[int, ServeRequest, PromptPrefill | None]] = collections.deque()
        self._running: dict[int, ServeRequest] = {}
        self._closing = False
        self._stopped = False
        self._fetch_pool = ThreadPoolExecutor(max_workers=config.fetch_workers, thread_name_prefix="kvlab-serve-fetch")
        self._thread = threading.Thread(target=self._loop, name="kvlab-serve-engine", daemon=True)
        self._thread.start()

    # ----- called from other threads

    def submit(self, request: ServeRequest) -> None:
        """Queue `request`; its events go to `request.sink`.

        Raises:
            ServerBusyError: `max_num_seqs + max_queued_requests` requests are already in the system.
            EngineClosedError: The engine is shutting down.
        """
        with self._cond:
            if self.failure is not None:
                raise EngineClosedError(f"the engine failed ({self.failure}); the server is stopping")
            if self._closing:
                raise EngineClosedError("the server is shutting down")
            in_system = len(self._fetching) + len(self._ready) + len(self._prefilling) + len(self._running)
            if in_system >= self.config.max_num_seqs + self.config.max_queued_requests:
                raise ServerBusyError(
                    f"the server is at capacity ({self.config.max_num_seqs} running, "
                    f"{self.config.max_queued_requests} queued); retry later"
                )
            if self.prefixes is None:
                self._ready.append(request)
                self._cond.notify()
            else:
                self._fetching.add(request)
                self._fetch_pool.submit(self._fetch, request)
            self._update_gauges()

    def cancel(self, request: ServeRequest) -> None:
        """Drop `request` at the engine's next tick (its client went away); no further events."""
        with self._cond:
            request.cancelled = True
            self._cond.notify()

    def shutdown(self, timeout_s: float = 0.0) -> None:
        """Take no new requests, let running and queued ones finish for up to `timeout_s`, cancel the
        rest, then finish pending prefix writes."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline and self.num_in_system():
            time.sleep(0.02)
        with self._cond:
            waiting = [*self._fetching, *self._ready, *(entry[1] for entry in self._prefilling)]
            for request in [*waiting, *self._running.values()]:
                if not request.cancelled:
                    request.cancelled = True
                    request.sink(FailedEvent("the server shut down before the request finished"))
            self._cond.notify()
        self._fetch_pool.shutdown(wait=True, cancel_futures=True)
        with self._cond:
            self._fetching.clear()  # fetches cancelled before they ran; their requests were told above
            self._ready.clear()
            self._stopped = True
            self._cond.notify()
        self._thread.join()
        if self.prefixes is not None:
            self.prefixes.close()

    @property
    def closing(self) -> bool:
        """Shutting down: no new requests are taken."""
        return self._closing

    def num_in_system(self) -> int:
        with self._cond:
            return len(self._fetching) + len(self._ready) + len(self._prefilling) + len(self._running)

    # ----- fetch workers

    def _fetch(self, request: ServeRequest) -> None:
        assert self.prefixes is not None
        self.metrics.fetching.inc()
        try:
            if not request.cancelled:
                request.fetched = self.prefixes.fetch(request.cache_salt, request.prompt)
        finally:
            self.metrics.fetching.dec()
            with self._cond:
                self._fetching.discard(request)
                self._ready.append(request)
                self._cond.notify()

    # ----- the engine thread

    def _loop(self) -> None:
        try:
            self._serve_until_stopped()
        except BaseException as error:  # noqa: BLE001 - a dead engine must fail its requests, not hang them
            logger.exception("the engine thread failed; failing every request and refusing new ones")
            self._die(f"{type(error).__name__}: {error}")

    def _die(self, reason: str) -> None:
        """Fail every request in the system and refuse new ones: the engine thread is gone."""
        with self._cond:
            self.failure = reason
            self._closing = True
            waiting = [*self._fetching, *self._ready, *(entry[1] for entry in self._prefilling), *self._running.values()]
            self._fetching.clear()
            self._ready.clear()
            self._prefilling.clear()
            self._running.clear()
        for request in waiting:
            if not request.cancelled:
                request.cancelled = True
                self._fail(request, f"the engine failed: {reason}")
        if self.on_failure is not None:
            self.on_failure()

    @property
    def healthy(self) -> bool:
        """The engine thread is alive and has not failed."""
        return self.failure is None and self._thread.is_alive()

    def _serve_until_stopped(self) -> None:
        while True:
            with self._cond:
                while not (self._ready or self._prefilling or self.run.sequences or self._stopped):
                    self._cond.wait()
                if self._stopped and not (self._prefilling or self._running):
                    return
                self._admit()
            self._drop_cancelled()
            if self._prefilling:
                self._prefill_step()
            if self.run.sequences:
                self._decode_step()
            self._recycle_run()

    def _admit(self) -> None:
        """Move ready requests into prefill while the batch has room (caller holds the lock)."""
        while self._ready and len(self._prefilling) + len(self._running) < self.config.max_num_seqs:
            request = self._ready.popleft()
            if request.cancelled:
                self.metrics.failed("cancelled")
                continue
            try:
                index = self.run.add_request(request.config, request.lossless)
            except Exception as error:  # noqa: BLE001 - one request's failure is that request's alone
                logger.exception("admitting a request failed")
                self._fail(request, f"admission failed: {type(error).__name__}: {error}")
                continue
            request.prefill_start_s = time.perf_counter()
            self._prefilling.append((index, request, None))
        self._update_gauges()

    def _drop_cancelled(self) -> None:
        with self._cond:
            for entry in [e for e in self._prefilling if e[1].cancelled]:
                self._prefilling.remove(entry)
                self.run.release(entry[0])
                self.metrics.failed("cancelled")
            for index, request in [item for item in self._running.items() if item[1].cancelled]:
                del self._running[index]
                self.run.cancel(index)
                self.metrics.failed("cancelled")
            self._update_gauges()

    def _prefill_step(self) -> None:
        index, request, job = self._prefilling[0]
        try:
            if job is None:
                job = self._start_prefill(index, request)
                self._prefilling[0] = (index, request, job)
            self.metrics.prefix_recomputed_tokens.inc(job.next_piece_tokens)
            job.step()
            if not job.done:
                return
            with self._cond:
                self._prefilling.popleft()
                self._running[index] = request
            assert job.logits is not None
            draft = job.draft if request.mode == "lossless" else None
            admit_prefilled(self.run, index, request.prompt, (job.cache, draft, job.logits))
            admitted = self.run.sequences[-1] if self.run.sequences else None
            if draft is not None and admitted is not None and admitted.request == index:
                request.rounds = admitted.stats  # updated in place by every round of the sequence
        except Exception as error:
            logger.exception("prefill of a request failed")
            with self._cond:
                if self._prefilling and self._prefilling[0][1] is request:
                    self._prefilling.popleft()
                self._running.pop(index, None)
            self.run.cancel(index)
            self._fail(request, f"prefill failed: {type(error).__name__}: {error}")
            return
        self._collect_finished()

    def _start_prefill(self, index: int, request: ServeRequest) -> PromptPrefill:
        prefix = None if self.prefixes is None else self.prefixes.get(request.cache_salt)
        lossless = request.mode == "lossless"
        job = PromptPrefill(
            self.loaded,
            request.prompt,
            self.run.capacity(request.prompt, index),
            compressor=request.compressor if request.mode == "lossy" else None,
            drafter=request.compressor if lossless else None,
            prefix=prefix,
            prefix_resolutions=EXACT if lossless else None,
            chunk_tokens=None if prefix is not None else self.config.prefill_chunk_tokens,
            fetched=request.fetched,
        )
        request.fetched = None  # restored into the caches; the transfer buffers can go
        self.metrics.prompt_tokens.inc(len(request.prompt))
        self.metrics.prefix_fetched_tokens.inc(job.reused_tokens)
        request.cached_tokens = job.reused_tokens
        return job

    def _decode_step(self) -> None:
        try:
            self.run.step()
        except Exception as error:
            logger.exception("a decoding step failed; failing the running requests")
            with self._cond:
                failed = list(self._running.items())
                self._running.clear()
            for index, request in failed:
                self.run.cancel(index)
                self._fail(request, f"decoding failed: {type(error).__name__}: {error}")
            return
        self._collect_finished()
        if self.run.lossless_stats.rounds > MAX_RUN_ROUNDS:
            self.run.lossless_stats = LosslessStats()

    def _collect_finished(self) -> None:
        finished = [(i, r) for i, r in self._running.items() if self.run.rows.reasons[i] is not None]
        for index, request in finished:
            output = self.run.output(index)
            stats = request.finish_stats(len(output.token_ids))
            if request.last_token_s is not None:
                self.metrics.e2e.observe(request.last_token_s - request.arrival_s)
            if request.rounds is not None:
                self.metrics.num_drafts.inc(request.rounds.rounds)
                self.metrics.num_draft_tokens.inc(request.rounds.num_draft_tokens)
                self.metrics.num_accepted_tokens.inc(request.rounds.num_accepted_tokens)
            with self._cond:
                del self._running[index]
                self._update_gauges()
            self.run.release(index)
            self.metrics.finished("stop" if output.stop_reason in ("eos", "stop_string") else output.stop_reason)
            request.sink(FinishedEvent(output, stats))

    def _fail(self, request: ServeRequest, message: str) -> None:
        self.metrics.failed("error")
        request.sink(FailedEvent(message))
        with self._cond:
            self._update_gauges()

    def _on_tokens(self, index: int, tokens: list[int]) -> None:
        request = self._running.get(index)
        if request is None:
            return
        now = time.perf_counter()
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
        request.sink(TokensEvent(list(tokens)))

    def _new_run(self) -> LosslessRun:
        return LosslessRun(self.loaded, GenerationConfig(), self.default_lossless, 0, on_tokens=self._on_tokens)

    def _recycle_run(self) -> None:
        with self._cond:
            if not self._running and not self._prefilling and len(self.run.rows.generated) > MAX_RUN_REQUESTS:
                self.run = self._new_run()

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self._prefilling) + len(self._running))
        self.metrics.waiting.set(len(self._fetching) + len(self._ready))
