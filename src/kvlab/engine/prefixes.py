"""Where the engine finds stored prefixes: stores by cache salt, and a background fetcher.

Fetch-aware admission: a request's prefix is fetched before the request is admitted, so the fetch
overlaps the other requests' decoding. The fetcher first looks up the prompt's first chunk (one small
request) on one set of workers, and only a prompt whose first chunk is stored goes on to the fetch, on
another: a slow fetch never holds up the lookups of requests that have nothing to fetch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from kvlab.store.prefix import FetchedPrefix, FetchStats, PrefixSource

logger = logging.getLogger(__name__)


class PrefixSources(Protocol):
    """Prefix stores by cache salt (a server keeps one namespace per tenant)."""

    def get(self, salt: str | None) -> PrefixSource: ...


@dataclasses.dataclass(frozen=True, slots=True)
class SinglePrefixSource:
    """One prefix store for every request, whatever its salt."""

    source: PrefixSource

    def get(self, salt: str | None) -> PrefixSource:
        return self.source


class PrefixFetcher:
    """Fetches prompts' prefixes in the background (see the module docstring); never fails a request:
    a store that cannot answer means the prompt is computed in full (one warning)."""

    def __init__(self, sources: PrefixSources, workers: int) -> None:
        self.sources = sources
        self._lookups = ThreadPoolExecutor(workers, thread_name_prefix="kvlab-prefix-lookup")
        self._fetches = ThreadPoolExecutor(workers, thread_name_prefix="kvlab-prefix-fetch")

    def submit(
        self,
        salt: str | None,
        prompt: list[int],
        resolutions: tuple[str, ...] | None,
        on_done: Callable[[], None] | None,
    ) -> Future[FetchedPrefix]:
        """The prompt's stored leading chunks at `resolutions` (None: the store's), once fetched; nothing
        when its first chunk is not stored."""
        result: Future[FetchedPrefix] = Future()
        if on_done is not None:
            result.add_done_callback(lambda _: on_done())

        def fetch(source: PrefixSource) -> None:
            try:
                _settle(result, source.fetch(prompt, resolutions))
            except Exception as error:  # a failing store never fails the request
                _settle(result, _failed(error))

        def look_up() -> None:
            try:
                source = self.sources.get(salt)
                stored = bool(source.lookup(prompt, resolutions, limit=1))
            except Exception as error:  # a store that cannot answer means computing the prompt
                _settle(result, _failed(error))
                return
            if stored:
                self._fetches.submit(fetch, source)
            else:
                _settle(result, FetchedPrefix([], FetchStats()))

        self._lookups.submit(look_up)
        return result

    def close(self) -> None:
        """Stop the workers; queued lookups and fetches are dropped."""
        self._lookups.shutdown(wait=True, cancel_futures=True)
        self._fetches.shutdown(wait=True, cancel_futures=True)


def _settle(result: Future[FetchedPrefix], fetched: FetchedPrefix) -> None:
    if not result.cancelled():  # a cancelled request no longer waits for its prefix
        result.set_result(fetched)


def _failed(error: Exception) -> FetchedPrefix:
    logger.warning("prefix lookup or fetch failed (%s: %s); computing the whole prompt", type(error).__name__, error)
    return FetchedPrefix([], FetchStats(failure=f"{type(error).__name__}: {error}", faults=1))
