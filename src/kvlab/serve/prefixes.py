"""The server's prefix store: one `PrefixCache` per cache salt, all on the operator's one store."""

from __future__ import annotations

import collections
import logging
import threading

from kvlab.models import LoadedModel
from kvlab.store.backends.base import KVStore, create_store
from kvlab.store.prefix import PrefixCache, PrefixConfig

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
            config = PrefixConfig.for_decoding(chunk_tokens=self.chunk_tokens, cache_salt=salt)
            cache = PrefixCache.for_model(self.loaded, self.store, config)
            self._caches[salt] = cache
            evicted = self._caches.popitem(last=False)[1] if len(self._caches) > self.max_salts else None
        if evicted is not None:
            _close(evicted)
        return cache

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
    except Exception as error:  # saving is best effort
        logger.warning("writing prefix chunks failed at close (%s: %s)", type(error).__name__, error)
