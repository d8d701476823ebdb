"""The server's prefix store: one `PrefixCache` per cache salt, all on the operator's one store."""

from __future__ import annotations

import collections
import logging
import threading

from kvlab.models import LoadedModel
from kvlab.store.base import KVStore, create_store
from kvlab.store.prefix import FetchedPrefix, FetchStats, PrefixCache, PrefixConfig

logger = logging.getLogger(__name__)


class SaltedPrefixes:
    """Prefix caches by salt (None: the common namespace), opened on first use.

    A salt namespaces the keys (`PrefixConfig.cache_salt`), so tenants can neither read nor probe
    each other's prefixes. At most `max_salts` caches stay open; the least recently used one is
    closed (its pending writes finished) to make room.
    """

    def __init__(self, loaded: LoadedModel, url: str, chunk_tokens: int, max_salts: int) -> None:
        self.loaded = loaded
        self.store: KVStore = create_store(url)
        self.chunk_tokens = chunk_tokens
        self.max_salts = max_salts
        self._caches: collections.OrderedDict[str | None, PrefixCache] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, salt: str | None) -> PrefixCache:
        with self._lock:
            cache = self._caches.get(salt)
            if cache is not None:
                self._caches.move_to_end(salt)
                return cache
            config = PrefixConfig(chunk_tokens=self.chunk_tokens, cache_salt=salt)
            cache = PrefixCache.for_model(self.loaded, self.store, config)
            self._caches[salt] = cache
            evicted = self._caches.popitem(last=False)[1] if len(self._caches) > self.max_salts else None
        if evicted is not None:
            _close(evicted)
        return cache

    def fetch(self, salt: str | None, prompt: list[int]) -> FetchedPrefix:
        """The prompt's stored leading chunks (bit-exact only), or nothing. Never raises: a store that
        fails means the prompt is computed in full."""
        try:
            cache = self.get(salt)
            if not cache.lookup(prompt, limit=1):
                return FetchedPrefix([], FetchStats())
            return cache.fetch(prompt)
        except Exception as error:  # noqa: BLE001 - a failing store never fails the request
            logger.warning("prefix fetch failed (%s: %s); computing the whole prompt", type(error).__name__, error)
            return FetchedPrefix([], FetchStats(failure=f"{type(error).__name__}: {error}", faults=1))

    def close(self) -> None:
        """Finish every pending write (failures are logged, never raised: shutdown goes on)."""
        with self._lock:
            caches = list(self._caches.values())
            self._caches.clear()
        for cache in caches:
            _close(cache)


def _close(cache: PrefixCache) -> None:
    try:
        cache.close()
    except Exception as error:  # noqa: BLE001 - saving is best effort
        logger.warning("writing prefix chunks failed at close (%s: %s)", type(error).__name__, error)
