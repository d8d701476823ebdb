"""Prompt-prefix KV reuse through a store: find the longest stored prefix, fetch it, save new chunks.

`PrefixCache.fetch(tokens)` looks up which leading chunks of a prompt are stored, plans a resolution
per chunk (`kvlab.store.prefix.planner`) from what it has measured so far (link throughput, decode speed,
chunk sizes, prefill speed), and runs the pipeline of `kvlab.store.prefix.fetcher`. Any fault (store down,
chunk missing, a value larger than a chunk can be, a Redis key of another type, a hard-linked file,
authentication, checksum, geometry or dtype mismatch, NaN, an allocation that fails)
ends the fetch at that chunk: the caller recomputes from there, so output stays identical; the fault
is logged once per fetch, naming the chunk's key, and counted in `fault_counts`.

`PrefixCache.save(tokens, start, layer_kv)` writes the complete chunks a prefill computed, at every
configured resolution, from a background thread (`flush()` waits for it and raises what it could
not handle). With a store secret (`kvlab.store.auth`) every chunk is authenticated.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Protocol

import torch

from kvlab.cache import LayerKV
from kvlab.errors import ConfigError
from kvlab.models import LoadedModel, model_identity
from kvlab.store.auth import ChunkAuthError, ChunkSealer, warn_if_unauthenticated
from kvlab.store.backends.base import KVStore, StoredValueError, StoreUnavailableError, create_store
from kvlab.store.keys import chunk_keys, fingerprint
from kvlab.store.prefix.config import PrefixConfig
from kvlab.store.prefix.fetched import FetchedPrefix, FetchStats
from kvlab.store.prefix.fetcher import Estimates, Fault, PrefixFetcher
from kvlab.store.prefix.writer import ChunkWriter
from kvlab.store.resolution import RESOLUTIONS, ChunkGeometry, encode_chunk
from kvlab.timing import Stopwatch

# One logger name for every fetch fault, which users and tests filter on.
logger = logging.getLogger("kvlab.store")


def fault_kind(error: BaseException) -> str:
    """The `PrefixCache.fault_counts` key of a fault: auth, store, or the exception's class name."""
    if isinstance(error, ChunkAuthError):
        return "auth"
    return "store" if isinstance(error, StoreUnavailableError) else type(error).__name__


class PrefixSource(Protocol):
    """What prefill needs from a prefix store (`PrefixCache`, or a scheduler's prefetched results)."""

    @property
    def chunk_tokens(self) -> int: ...

    def lookup(
        self, tokens: list[int], resolutions: tuple[str, ...] | None = None, limit: int | None = None
    ) -> list[list[str]]: ...

    def fetch(
        self, tokens: list[int], resolutions: tuple[str, ...] | None = None, chunks: list[int] | None = None
    ) -> FetchedPrefix: ...

    def observe_prefill(self, tokens: int, seconds: float) -> None: ...

    def save(self, tokens: list[int], start: int, layer_kv: LayerKV) -> None: ...


class PrefixCache:
    """Reuse of prompt-prefix KV through `store` for one model.

    Args:
        store: Where chunks live (any `kvlab.store` backend, or a `ThrottledStore` around one).
        model_identity: `kvlab.models.model_identity(model)`: KV is only reused by the same model.
        raw_bytes_per_token: fp32-equivalent bytes of one token's KV, all layers (sizes the planner's
            priors, and bounds what a stored chunk may decode to).
        config: Chunking and resolutions.
        geometry: What a stored chunk must hold for this model (`for_model` knows it); without it,
            only the token count and the size bound are checked.
        sealer: Chunk authentication (default: from `KVLAB_STORE_SECRET` / `KVLAB_STORE_SECRET_FILE`).
    """

    def __init__(
        self,
        store: KVStore,
        model_identity: str,
        raw_bytes_per_token: int,
        config: PrefixConfig | None = None,
        geometry: ChunkGeometry | None = None,
        sealer: ChunkSealer | None = None,
    ) -> None:
        self.store = store
        self.model_identity = model_identity
        self.raw_bytes_per_token = raw_bytes_per_token
        self.config = config or PrefixConfig()
        self.sealer = sealer or ChunkSealer.from_environment()
        # An fp32 chunk of keys (or values) is half the chunk's fp32-equivalent bytes.
        chunk_tokens = self.config.chunk_tokens
        self.geometry = geometry or ChunkGeometry(chunk_tokens, raw_bytes_per_token * chunk_tokens // 2)
        if self.geometry.num_tokens != chunk_tokens:
            raise ConfigError(f"geometry of {self.geometry.num_tokens}-token chunks for chunk_tokens={chunk_tokens}")
        self.estimates = Estimates(self.config)
        self.fault_counts: dict[str, int] = {}
        self._fetcher = PrefixFetcher(self.config, self.estimates, self.sealer, self.geometry, raw_bytes_per_token)
        self._writer = ChunkWriter()
        self._down_until = 0.0
        # Keys whose value failed to open or decode: the next save of that chunk overwrites it, so one
        # corrupted value costs one recompute, not one per later prompt.
        self._rewrite: set[str] = set()
        self._rewrite_lock = threading.Lock()
        warn_if_unauthenticated(self.sealer, store.url or type(store).__name__, store.shared)

    @classmethod
    def for_model(
        cls,
        loaded: LoadedModel,
        store: KVStore | str,
        config: PrefixConfig | None = None,
        sealer: ChunkSealer | None = None,
    ) -> PrefixCache:
        """A prefix cache for `loaded` on `store` (a store or its URL) that accepts only chunks of its
        geometry and dtype."""
        config = config or PrefixConfig()
        sealer = sealer or ChunkSealer.from_environment()
        backend = create_store(store) if isinstance(store, str) else store
        architecture = loaded.architecture
        raw_bytes_per_token = architecture.kv_bytes_per_token(element_size=4)
        geometry = ChunkGeometry(
            num_tokens=config.chunk_tokens,
            max_bytes=architecture.kv_bytes_per_token(element_size=torch.empty(0, dtype=loaded.dtype).element_size())
            * config.chunk_tokens // 2,
            num_layers=architecture.num_layers,
            num_kv_heads=architecture.num_kv_heads,
            head_dim=architecture.head_dim,
            dtype=loaded.dtype,
        )
        return cls(backend, model_identity(loaded.model), raw_bytes_per_token, config, geometry, sealer)

    @property
    def chunk_tokens(self) -> int:
        return self.config.chunk_tokens

    @property
    def authenticated(self) -> bool:
        """Whether chunks are authenticated under a store secret."""
        return self.sealer.authenticated

    # ----- keys and lookup

    def keys(self, tokens: list[int], resolution: str) -> list[str]:
        """Store keys of the complete chunks of `tokens` at `resolution`."""
        described = {"resolution": resolution, **RESOLUTIONS[resolution].describe(), "chunk": self.config.chunk_tokens}
        root = fingerprint(self.model_identity, None, described, self.config.cache_salt)
        return chunk_keys(tokens, self.config.chunk_tokens, root)

    def reusable_chunks(self, num_tokens: int) -> int:
        """Chunks of a prompt of `num_tokens` that may be restored: at least one token is left to compute,
        since the first output token needs the last prompt token's logits."""
        return (num_tokens - 1) // self.config.chunk_tokens

    def lookup(
        self, tokens: list[int], resolutions: tuple[str, ...] | None = None, limit: int | None = None
    ) -> list[list[str]]:
        """Stored resolutions (of `resolutions`, default the configured `fetch`) of each leading chunk
        that has any; stops at the first chunk with none, or after `limit` chunks."""
        resolutions = resolutions or self.config.fetch
        reusable = self.reusable_chunks(len(tokens))
        limit = reusable if limit is None else min(limit, reusable)
        keys = {name: self.keys(tokens, name)[:limit] for name in resolutions}
        available: list[list[str]] = []
        for index in range(limit):
            here = [name for name in resolutions if self._present(keys[name][index])]
            if not here:
                break
            available.append(here)
        return available

    def _present(self, key: str) -> bool:
        """Whether `key` holds something; a key the store refuses to size (a Redis hash, ...) counts, so
        the fetch meets it at its own chunk, reuses the chunks before it and has it rewritten."""
        try:
            return self.store.contains(key)
        except StoredValueError:
            return True

    # ----- fetch

    def fetch(
        self, tokens: list[int], resolutions: tuple[str, ...] | None = None, chunks: list[int] | None = None
    ) -> FetchedPrefix:
        """Restore as many leading chunks of `tokens` as is worth it (see the module docstring).

        Args:
            tokens: The prompt.
            resolutions: Resolutions to choose from (default: the configured `fetch`).
            chunks: Fetch exactly these chunk indices (those stored; never recomputed) instead of
                the leading run the planner picks, e.g. a drafter's window of the prefix. Negative
                indices count from the end of the stored run, as in Python.

        Never raises for store or data faults (any `Exception`): they end the fetch early, are
        logged once and counted. KeyboardInterrupt and SystemExit go on up.
        """
        clock = Stopwatch()
        stats = FetchStats()
        fetched = FetchedPrefix([], stats)
        if time.monotonic() < self._down_until:
            stats.failure = "store marked unreachable"
            return fetched
        available: list[list[str]] = []
        try:
            available = self.lookup(tokens, resolutions)
            stats.stored_tokens = len(available) * self.config.chunk_tokens
            stored = len(available)
            wanted = range(stored) if chunks is None else {i + stored if i < 0 else i for i in chunks}
            indices = sorted(i for i in wanted if 0 <= i < stored)
            fault = None
            if indices:
                keys = {name: self.keys(tokens, name) for name in {name for here in available for name in here}}
                fault = self._fetcher.run(self.store, keys, available, indices, chunks is None, fetched)
        except Exception as error:
            fault, fetched = Fault(error, -1, None), FetchedPrefix([], stats)
        if fault is not None:
            self._fail(stats, fault, len(available))
        stats.fetched_tokens = fetched.num_tokens
        stats.fetch_s = clock.elapsed()
        return fetched

    def _fail(self, stats: FetchStats, fault: Fault, total: int) -> None:
        """Record, count and log why the fetch ends at chunk `fault.index` (-1: before any chunk).

        A chunk already found broken and not yet rewritten is the same fault met again (two fetches of
        one prompt, such as a background prefetch and a lossless verifier's exact fetch): it is neither
        counted nor logged twice.
        """
        error = fault.error
        stats.failure = f"{type(error).__name__}: {error}"
        stats.failed_key, stats.faults = fault.key, 1
        retry = ""
        if isinstance(error, StoreUnavailableError):
            self._down_until = time.monotonic() + self.config.retry_after_s
            retry = f"; not trying the store again for {self.config.retry_after_s:g} s"
        elif fault.key is not None:
            with self._rewrite_lock:
                repeated = fault.key in self._rewrite
                self._rewrite.add(fault.key)
            if repeated:
                logger.debug("prefix fetch met chunk %s again before its rewrite (%s)", fault.key, stats.failure)
                return
            retry += "; the chunk will be rewritten when recomputed"
        kind = fault_kind(error)
        self.fault_counts[kind] = self.fault_counts.get(kind, 0) + 1
        where = self.store.url or type(self.store).__name__
        if fault.index < 0:
            logger.warning("prefix lookup in %s failed (%s); computing the whole prompt%s", where, stats.failure, retry)
            return
        logger.warning(
            "prefix fetch stopped at chunk %d of %d (key %s in %s: %s); recomputing from token %d%s",
            fault.index, total, fault.key, where, stats.failure, fault.index * self.config.chunk_tokens, retry,
        )

    # ----- measurements from the engine

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill computed `tokens` tokens in `seconds` (the planner's recompute cost)."""
        self.estimates.observe_prefill(tokens, seconds)

    # ----- save

    def save(self, tokens: list[int], start: int, layer_kv: LayerKV) -> None:
        """Queue the complete chunks of `tokens` from `start` for writing, at every `write` resolution.

        Args:
            tokens: The whole prompt.
            start: Token index where `layer_kv` begins (a multiple of `chunk_tokens`).
            layer_kv: Per layer, [1, H_kv, T, D] keys and values of tokens `start:start + T`.
        """
        size = self.config.chunk_tokens
        if start % size:
            raise ValueError(f"save must start at a chunk boundary, got token {start}")
        if not layer_kv or not self.config.write:
            return
        num_computed = layer_kv[0][0].shape[2]
        first, end = start // size, (start + num_computed) // size
        if end <= first or time.monotonic() < self._down_until:
            return
        keys_by_resolution = {name: self.keys(tokens, name) for name in self.config.write}
        for chunk in range(first, end):
            begin = chunk * size - start
            # Copies now: the caller's tensors may be overwritten while the writer still works.
            keys = torch.stack([k[0, :, begin : begin + size] for k, _ in layer_kv]).cpu()
            values = torch.stack([v[0, :, begin : begin + size] for _, v in layer_kv]).cpu()
            names = {name: keys_by_resolution[name][chunk] for name in self.config.write}
            self._writer.submit(functools.partial(self._write_chunk, names, keys, values))

    def _write_chunk(self, keys_by_resolution: dict[str, str], keys: torch.Tensor, values: torch.Tensor) -> None:
        for name, key in keys_by_resolution.items():
            if self._stored_intact(name, key):
                continue
            self.store.put(key, self.sealer.seal(key, encode_chunk(RESOLUTIONS[name], keys, values)))

    def _stored_intact(self, name: str, key: str) -> bool:
        """Whether `key` holds a value worth keeping: not one a fetch found broken; any other value
        without a secret (values are write-once); with one, only a value of a chunk's size at most
        whose tag verifies (so a planted value is replaced, not kept forever). What the store refuses
        to read (too large, a wrong-type key, a hard link) is not worth keeping."""
        with self._rewrite_lock:
            if key in self._rewrite:
                self._rewrite.discard(key)
                return False
        try:
            if not self.sealer.authenticated:
                return self.store.contains(key)
            stored = self.store.get(key, self._fetcher.max_value_bytes(name))
        except StoredValueError:
            return False
        if stored is None:
            return False
        try:
            self.sealer.open(key, stored)
        except ChunkAuthError:
            return False
        return True

    def flush(self) -> None:
        """Wait until every queued chunk is written (or failed); raises what the writer could not handle."""
        self._writer.flush()

    def close(self) -> None:
        """Finish pending writes and stop the writer thread (the store stays open); raises like `flush`."""
        self._writer.close()
