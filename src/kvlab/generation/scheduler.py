"""Serving a stream of requests when some need a prefix fetched first.

Requests arrive over time. One compute worker (the calling thread) generates one request at a time.
With `fetch_aware=True`, a request whose prefix is stored is handed to a fetch worker when it
arrives; it joins the ready queue only once its KV has landed, so requests that need no fetch (or
whose fetch finished) keep the model busy meanwhile: no head-of-line blocking. With
`fetch_aware=False` requests run strictly in arrival order and each fetch happens on the critical path.

Output is the same either way: a prefetched prefix is restored exactly as `generate` would restore it.
Every admitted request is completed or failed, never left waiting: a store that is down at admission
means no background fetch, a fetch that fails means recomputing the whole prompt, and a request
whose generation raises is reported in `SchedulerError` after every other request was served.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvlab.errors import KvlabError
from kvlab.generation import GenerationOutput, generate
from kvlab.generation.config import GenerationConfig
from kvlab.models import LoadedModel
from kvlab.store.prefix import FetchedPrefix, FetchStats, LayerKV, PrefixCache
from kvlab.timing import Stopwatch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One prompt to serve, arriving `arrival_s` seconds after the run starts."""

    prompt: list[int]
    config: GenerationConfig
    arrival_s: float = 0.0


@dataclasses.dataclass(slots=True)
class Completion:
    """When a request went through the system (seconds from the run's start).

    Attributes:
        index: Position of the request in the submitted list.
        output: What generation returned.
        arrival_s: When it arrived.
        fetch_done_s: When its prefix fetch finished (None: no fetch ran in the background).
        started_s: When the compute worker took it.
        first_token_s: When its first token was out.
        finished_s: When its last token was out.
    """

    index: int
    output: GenerationOutput
    arrival_s: float
    fetch_done_s: float | None
    started_s: float
    first_token_s: float
    finished_s: float

    @property
    def ttft_s(self) -> float:
        """Time to first token as the client sees it: from arrival, queueing included."""
        return self.first_token_s - self.arrival_s


class SchedulerError(KvlabError):
    """Some requests failed; every other request was served.

    Attributes:
        failures: Exception of each failed request, by its index in the submitted list.
        completions: The served requests, by index.
    """

    def __init__(self, failures: dict[int, Exception], completions: dict[int, Completion]) -> None:
        first = min(failures)
        super().__init__(
            f"{len(failures)} of {len(failures) + len(completions)} requests failed; request {first}: "
            f"{type(failures[first]).__name__}: {failures[first]}"
        )
        self.failures = failures
        self.completions = completions


class _Prefetched:
    """A prefix source that hands out a result fetched earlier, and otherwise defers to `cache`."""

    def __init__(self, cache: PrefixCache, tokens: list[int], fetched: FetchedPrefix) -> None:
        self.cache = cache
        self.tokens = tokens
        self.fetched = fetched

    @property
    def chunk_tokens(self) -> int:
        return self.cache.chunk_tokens

    def lookup(
        self, tokens: list[int], resolutions: tuple[str, ...] | None = None, limit: int | None = None
    ) -> list[list[str]]:
        return self.cache.lookup(tokens, resolutions, limit)

    def fetch(
        self, tokens: list[int], resolutions: tuple[str, ...] | None = None, chunks: list[int] | None = None
    ) -> FetchedPrefix:
        if tokens == self.tokens and resolutions is None and chunks is None:
            return self.fetched
        return self.cache.fetch(tokens, resolutions, chunks)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.cache.observe_prefill(tokens, seconds)

    def save(self, tokens: list[int], start: int, layer_kv: LayerKV) -> None:
        self.cache.save(tokens, start, layer_kv)


class FetchAwareScheduler:
    """Serve requests with prefix reuse, fetching in the background (see the module docstring).

    Args:
        loaded: The model.
        prefix: Where prefixes are stored.
        fetch_aware: Fetch in the background and run whatever is ready (True), or run in arrival
            order with fetches inline (False, the baseline).
        fetch_workers: Fetches that may run at once.
    """

    def __init__(self, loaded: LoadedModel, prefix: PrefixCache, fetch_aware: bool = True, fetch_workers: int = 1) -> None:
        self.loaded = loaded
        self.prefix = prefix
        self.fetch_aware = fetch_aware
        self.fetch_workers = fetch_workers

    def run(self, requests: list[Request]) -> list[Completion]:
        """Serve `requests` (arrival times relative to now); completions in submission order.

        Raises:
            SchedulerError: Some requests failed (after every other one was served).
        """
        clock = Stopwatch()

        def now() -> float:
            return clock.elapsed()

        order = sorted(range(len(requests)), key=lambda index: requests[index].arrival_s)
        ready: queue.PriorityQueue[tuple[float, int]] = queue.PriorityQueue()
        # Written by fetch workers before they queue the request, read after it is dequeued.
        fetched: dict[int, tuple[FetchedPrefix, float]] = {}
        completions: dict[int, Completion] = {}
        failures: dict[int, Exception] = {}

        def fetch(index: int) -> None:
            result = FetchedPrefix([], FetchStats(failure="the fetch did not finish", faults=1))
            try:
                result = self.prefix.fetch(requests[index].prompt)
            except Exception as error:  # noqa: BLE001 - the request is then computed in full
                logger.warning("prefix fetch of request %d failed (%s: %s); computing its whole prompt",
                               index, type(error).__name__, error)
                result = FetchedPrefix([], FetchStats(failure=f"{type(error).__name__}: {error}", faults=1))
            finally:
                # Queued whatever happened: a request the worker never hands on would wait forever.
                fetched[index] = (result, now())
                ready.put((requests[index].arrival_s, index))

        with ThreadPoolExecutor(max_workers=self.fetch_workers, thread_name_prefix="kvlab-prefetch") as pool:
            admitted = 0
            while len(completions) + len(failures) < len(requests):
                # Admit everything that has arrived by now.
                while admitted < len(order) and requests[order[admitted]].arrival_s <= now():
                    index = order[admitted]
                    admitted += 1
                    if self._worth_fetching(requests[index].prompt):
                        pool.submit(fetch, index)
                    else:
                        ready.put((requests[index].arrival_s, index))
                next_arrival = requests[order[admitted]].arrival_s if admitted < len(order) else None
                timeout = None if next_arrival is None else max(0.0, next_arrival - now())
                try:
                    _, index = ready.get(timeout=timeout)
                except queue.Empty:
                    continue
                try:
                    completions[index] = self._serve(index, requests[index], fetched.get(index), now)
                except Exception as error:  # noqa: BLE001 - reported with the others' results
                    failures[index] = error
        if failures:
            raise SchedulerError(failures, completions)
        return [completions[index] for index in range(len(requests))]

    def _worth_fetching(self, prompt: list[int]) -> bool:
        """Whether to fetch in the background: the first chunk is stored (one small request; the fetch
        does the full lookup). A store that cannot answer means no: the request is computed in full."""
        if not self.fetch_aware:
            return False
        try:
            return bool(self.prefix.lookup(prompt, limit=1))
        except Exception as error:  # noqa: BLE001 - admission never fails on the store
            logger.warning("prefix lookup at admission failed (%s: %s); computing the prompt", type(error).__name__, error)
            return False

    def _serve(
        self, index: int, request: Request, prefetched: tuple[FetchedPrefix, float] | None, now: Callable[[], float]
    ) -> Completion:
        started = now()
        source = self.prefix if prefetched is None else _Prefetched(self.prefix, request.prompt, prefetched[0])
        output = generate(self.loaded, [request.prompt], request.config, prefix=source)
        finished = now()
        return Completion(
            index=index,
            output=output,
            arrival_s=request.arrival_s,
            fetch_done_s=None if prefetched is None else prefetched[1],
            started_s=started,
            first_token_s=started + output.stats.ttft_s,
            finished_s=finished,
        )
