"""Prompt-prefix KV reuse through a store: find the longest stored prefix, fetch it, save new chunks.

`PrefixCache.fetch(tokens)` looks up which leading chunks of a prompt are stored, plans a resolution
per chunk (`kvlab.store.planner`) from what it has measured so far (link throughput, decode speed,
chunk sizes, prefill speed), and runs a pipeline: one thread transfers chunk i+1 while worker
threads decode the chunks before it, and the caller restores them in order. Before every chunk it
re-plans the rest, so a link that slows down shifts the remaining chunks to smaller resolutions or
to recomputation. Any failure (store down, chunk missing, checksum mismatch, wrong shape) ends the
fetch at that chunk: the caller recomputes from there, so output stays identical; the failure is
logged once per fetch.

`PrefixCache.save(tokens, start, layer_kv)` writes the complete chunks a prefill computed, at every
configured resolution, from a background thread (`flush()` waits for it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from kvlab.cache import KVCache
from kvlab.codec import CodecError
from kvlab.errors import ConfigError
from kvlab.models import LoadedModel, model_identity
from kvlab.store.base import KVStore, StoreUnavailableError, create_store
from kvlab.store.keys import chunk_keys, fingerprint
from kvlab.store.planner import RECOMPUTE, ResolutionCost, plan_chunks
from kvlab.store.resolution import RESOLUTIONS, Resolution, decode_chunk, encode_chunk, get_resolution

logger = logging.getLogger("kvlab.store")

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, ([1, H_kv, T, D] keys, values), as a forward computes them."""

_Arrival = tuple[int, str, "Future[tuple[torch.Tensor, torch.Tensor, float]] | None", int, float]
"""A transferred chunk: index, resolution, its decoding (None: the store had nothing), bytes, seconds."""


@dataclasses.dataclass(frozen=True)
class PrefixConfig:
    """How prefixes are stored and fetched.

    Attributes:
        chunk_tokens: Tokens per stored chunk (reuse works in whole chunks).
        write: Resolutions written for every new chunk (empty: only read).
        fetch: Resolutions the fetcher may use. Only bit-exact ones ("exact", "raw") keep output
            identical to recomputation; "int8"/"int4" trade exactness for transfer time.
        allow_recompute: Let the planner recompute chunks when that is faster than fetching them.
        quality_slack: Relative cost under which a higher-quality resolution is preferred.
        prior_bandwidth_bits: Link throughput assumed before the first transfer is measured.
        prior_prefill_tokens_per_s: Recompute speed assumed before a prefill is measured.
        retry_after_s: After the store is found unreachable, skip it for this long.
        decode_workers: Chunks decoded at once (codecs release the GIL in zstd, numpy and torch).
    """

    chunk_tokens: int = 256
    write: tuple[str, ...] = ("exact",)
    fetch: tuple[str, ...] = ("exact",)
    allow_recompute: bool = True
    quality_slack: float = 0.1
    prior_bandwidth_bits: float = 1e9
    prior_prefill_tokens_per_s: float = 500.0
    retry_after_s: float = 30.0
    decode_workers: int = 2

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be at least 1, got {self.chunk_tokens}")
        if self.decode_workers < 1:
            raise ConfigError(f"decode_workers must be at least 1, got {self.decode_workers}")
        if not self.fetch:
            raise ConfigError("fetch needs at least one resolution")
        for name in (*self.write, *self.fetch):
            get_resolution(name)
        if self.write and not set(self.fetch) <= set(self.write):
            # A writer that fetches what it never writes is almost certainly a mistake (a reader that
            # writes nothing, `write=()`, fetches what others wrote).
            missing = ", ".join(sorted(set(self.fetch) - set(self.write)))
            raise ConfigError(f"fetch resolutions {missing} are never written; add them to write")

    @property
    def identical(self) -> bool:
        """Every fetchable resolution restores the original bits."""
        return all(RESOLUTIONS[name].exact for name in self.fetch)


@dataclasses.dataclass(slots=True)
class FetchStats:
    """What one fetch did.

    Attributes:
        stored_tokens: Leading prompt tokens found in the store (whole chunks, capped so one prompt
            token is always computed).
        fetched_tokens: Tokens restored from the store.
        nbytes: Bytes transferred.
        fetch_s: Seconds from lookup to the last chunk decoded.
        transfer_s: Seconds spent in store reads (overlapping decoding).
        decode_s: Seconds spent decoding chunks.
        resolutions: Chunks fetched per resolution.
        failure: Why the fetch stopped early, if it did.
    """

    stored_tokens: int = 0
    fetched_tokens: int = 0
    nbytes: int = 0
    fetch_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    resolutions: dict[str, int] = dataclasses.field(default_factory=dict)
    failure: str | None = None


@dataclasses.dataclass(slots=True)
class FetchedPrefix:
    """Restored KV of some of a prompt's chunks: per chunk, its first token and keys and values
    `[L, H_kv, t, D]`. A plain fetch restores leading chunks without gaps."""

    chunks: list[tuple[torch.Tensor, torch.Tensor]]
    stats: FetchStats
    starts: list[int] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens restored."""
        return sum(keys.shape[2] for keys, _ in self.chunks)

    @property
    def end(self) -> int:
        """Token index after the last restored chunk: where computing the prompt resumes."""
        return self.starts[-1] + self.chunks[-1][0].shape[2] if self.chunks else 0

    def restore_into(self, cache: KVCache, device: torch.device | str) -> None:
        """Append every chunk, in order, to row 0 of a single-row `cache` whose tensors live on `device`.

        Chunks after a gap are stored right after the previous ones (compacted) while the cache's
        sequence length jumps over the gap, so later tokens get their true positions.
        """
        for start, (keys, values) in zip(self.starts, self.chunks):
            if start > cache.seq_lengths[0]:
                cache.advance(start - cache.seq_lengths[0])
            layer_kv = [(keys[layer][None].to(device), values[layer][None].to(device)) for layer in range(keys.shape[0])]
            cache.append(layer_kv, [keys.shape[2]])


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


class _Estimates:
    """Running measurements the planner reads (exponentially weighted, guarded by a lock)."""

    def __init__(self, config: PrefixConfig) -> None:
        self.bandwidth = config.prior_bandwidth_bits / 8
        self.prefill_tokens_per_s = config.prior_prefill_tokens_per_s
        self.ratio = {name: resolution.nominal_ratio for name, resolution in RESOLUTIONS.items()}
        # Decode seconds per raw byte; priors measured on 2 CPU threads (byteplane ~650 MB/s).
        self.decode_s_per_byte = {"raw": 1 / 4e9, "exact": 1 / 6.5e8, "int8": 1 / 4e8, "int4": 1 / 4e8}
        self.lock = threading.Lock()

    @staticmethod
    def _blend(old: float, new: float, weight: float = 0.5) -> float:
        return (1 - weight) * old + weight * new

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self.lock:
                self.bandwidth = self._blend(self.bandwidth, nbytes / seconds)

    def observe_decode(self, resolution: str, raw_bytes: int, stored_bytes: int, seconds: float) -> None:
        if raw_bytes > 0 and stored_bytes > 0 and seconds > 0:
            with self.lock:
                self.decode_s_per_byte[resolution] = self._blend(self.decode_s_per_byte[resolution], seconds / raw_bytes)
                self.ratio[resolution] = self._blend(self.ratio[resolution], raw_bytes / stored_bytes)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self.lock:
                self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, tokens / seconds)


class PrefixCache:
    """Reuse of prompt-prefix KV through `store` for one model.

    Args:
        store: Where chunks live (any `kvlab.store` backend, or a `ThrottledStore` around one).
        model_identity: `kvlab.models.model_identity(model)`: KV is only reused by the same model.
        raw_bytes_per_token: fp32-equivalent bytes of one token's KV, all layers (sizes the planner's priors).
        config: Chunking and resolutions.
    """

    def __init__(self, store: KVStore, model_identity: str, raw_bytes_per_token: int, config: PrefixConfig | None = None) -> None:
        self.store = store
        self.model_identity = model_identity
        self.raw_bytes_per_token = raw_bytes_per_token
        self.config = config or PrefixConfig()
        self.estimates = _Estimates(self.config)
        self._down_until = 0.0
        self._writes: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._write_failure_logged = False

    @classmethod
    def for_model(cls, loaded: LoadedModel, store: KVStore | str, config: PrefixConfig | None = None) -> PrefixCache:
        """A prefix cache for `loaded` on `store` (a store or its URL)."""
        backend = create_store(store) if isinstance(store, str) else store
        raw_bytes_per_token = loaded.architecture.kv_bytes_per_token(element_size=4)
        return cls(backend, model_identity(loaded.model), raw_bytes_per_token, config)

    @property
    def chunk_tokens(self) -> int:
        return self.config.chunk_tokens

    # ----- keys and lookup

    def keys(self, tokens: list[int], resolution: str) -> list[str]:
        """Store keys of the complete chunks of `tokens` at `resolution`."""
        described = {"resolution": resolution, **RESOLUTIONS[resolution].describe(), "chunk": self.config.chunk_tokens}
        return chunk_keys(tokens, self.config.chunk_tokens, fingerprint(self.model_identity, None, described))

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
            here = [name for name in resolutions if self.store.contains(keys[name][index])]
            if not here:
                break
            available.append(here)
        return available

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

        Never raises for store or data faults: they end the fetch early and are logged.
        """
        started = time.perf_counter()
        stats = FetchStats()
        fetched = FetchedPrefix([], stats)
        if time.perf_counter() < self._down_until:
            stats.failure = "store marked unreachable"
            return fetched
        try:
            available = self.lookup(tokens, resolutions)
        except Exception as error:  # noqa: BLE001 - any store fault means: recompute
            self._fail(stats, error, 0, None)
            return fetched
        stats.stored_tokens = len(available) * self.config.chunk_tokens
        stored = len(available)
        wanted = range(stored) if chunks is None else {i + stored if i < 0 else i for i in chunks}
        indices = sorted(i for i in wanted if 0 <= i < stored)
        if indices:
            self._pipeline(tokens, available, indices, chunks is None, fetched)
        stats.fetched_tokens = fetched.num_tokens
        stats.fetch_s = time.perf_counter() - started
        return fetched

    def _plan(self, available: list[list[str]], allow_recompute: bool) -> list[str]:
        """Resolutions for the chunks whose stored resolutions `available` lists, from the current estimates."""
        chunk_bytes = self.raw_bytes_per_token * self.config.chunk_tokens
        with self.estimates.lock:
            bandwidth = self.estimates.bandwidth
            options = [
                [
                    ResolutionCost(
                        name,
                        RESOLUTIONS[name].quality,
                        chunk_bytes / self.estimates.ratio[name],
                        chunk_bytes * self.estimates.decode_s_per_byte[name] / self.config.decode_workers,
                    )
                    for name in here
                ]
                for here in available
            ]
            # Recomputing chunk i attends over everything before it; prefill speed is measured on whole
            # prompts, so per-chunk cost is its token count at that speed.
            recompute = [self.config.chunk_tokens / self.estimates.prefill_tokens_per_s] * len(options)
        return plan_chunks(
            options,
            recompute,
            bandwidth,
            quality_slack=self.config.quality_slack,
            allow_recompute=allow_recompute and self.config.allow_recompute,
        )

    def _pipeline(
        self, tokens: list[int], available: list[list[str]], indices: list[int], plan_cut: bool, fetched: FetchedPrefix
    ) -> None:
        """Transfer chunks `indices` in a thread and decode them on `decode_workers` threads; restore in
        order here; stop at the planner's cut (when `plan_cut`) or the first fault."""
        keys = {name: self.keys(tokens, name) for name in {name for here in available for name in here}}
        arrivals: queue.Queue[_Arrival | BaseException | None] = queue.Queue(maxsize=self.config.decode_workers + 1)
        stop = threading.Event()
        decoders = ThreadPoolExecutor(self.config.decode_workers, thread_name_prefix="kvlab-prefix-decode")

        def transfer() -> None:
            try:
                for position, index in enumerate(indices):
                    if stop.is_set():
                        break
                    name = self._plan([available[i] for i in indices[position:]], plan_cut)[0]
                    if name == RECOMPUTE:
                        break
                    clock = time.perf_counter()
                    data = self.store.get(keys[name][index])
                    seconds = time.perf_counter() - clock
                    self.estimates.observe_transfer(len(data or b""), seconds)
                    decoding = None if data is None else decoders.submit(self._decode, RESOLUTIONS[name], data)
                    arrivals.put((index, name, decoding, len(data or b""), seconds))
            except BaseException as error:  # noqa: BLE001 - handed to the restoring side
                arrivals.put(error)
            finally:
                arrivals.put(None)

        thread = threading.Thread(target=transfer, name="kvlab-prefix-fetch", daemon=True)
        thread.start()
        stats = fetched.stats
        try:
            while (item := arrivals.get()) is not None:
                if isinstance(item, BaseException):
                    self._fail(stats, item, indices[len(fetched.chunks)], len(available))
                    break
                index, name, decoding, nbytes, seconds = item
                stats.transfer_s += seconds
                if decoding is None:
                    self._fail(stats, KeyError(f"chunk {index} ({name}) vanished from the store"), index, len(available))
                    break
                try:
                    keys_tensor, values_tensor, decode_s = decoding.result()
                except CodecError as error:
                    self._fail(stats, error, index, len(available))
                    break
                stats.decode_s += decode_s
                stats.nbytes += nbytes
                stats.resolutions[name] = stats.resolutions.get(name, 0) + 1
                raw = keys_tensor.numel() * 8  # keys + values at 4 bytes
                self.estimates.observe_decode(name, raw, nbytes, decode_s)
                fetched.chunks.append((keys_tensor, values_tensor))
                fetched.starts.append(index * self.config.chunk_tokens)
        finally:
            stop.set()
            # Unblock the transfer thread if it waits on a full queue, then let it finish.
            while thread.is_alive():
                try:
                    arrivals.get(timeout=0.05)
                except queue.Empty:
                    pass
            thread.join()
            decoders.shutdown(wait=True, cancel_futures=True)

    def _decode(self, resolution: Resolution, data: bytes) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Keys, values and the seconds decoding took."""
        clock = time.perf_counter()
        keys, values = decode_chunk(resolution, data)
        expected_tokens = self.config.chunk_tokens
        if keys.dim() != 4 or keys.shape[2] != expected_tokens:
            raise CodecError(f"stored chunk has shape {tuple(keys.shape)}, expected [L, H, {expected_tokens}, D]")
        return keys, values, time.perf_counter() - clock

    def _fail(self, stats: FetchStats, error: BaseException, index: int, total: int | None) -> None:
        """Record and log (once per fetch) why the fetch ends at chunk `index` (`total`: None at lookup)."""
        stats.failure = f"{type(error).__name__}: {error}"
        retry = ""
        if isinstance(error, StoreUnavailableError):
            self._down_until = time.perf_counter() + self.config.retry_after_s
            retry = f"; not trying the store again for {self.config.retry_after_s:g} s"
        if total is None:
            logger.warning("prefix lookup failed (%s); computing the whole prompt%s", stats.failure, retry)
            return
        logger.warning(
            "prefix fetch stopped at chunk %d of %d (%s); recomputing from token %d%s",
            index,
            total,
            stats.failure,
            index * self.config.chunk_tokens,
            retry,
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
        if end <= first or time.perf_counter() < self._down_until:
            return
        keys_by_resolution = {name: self.keys(tokens, name) for name in self.config.write}
        for chunk in range(first, end):
            begin = chunk * size - start
            # Copies now: the caller's tensors may be overwritten while the writer still works.
            keys = torch.stack([k[0, :, begin : begin + size] for k, _ in layer_kv]).cpu()
            values = torch.stack([v[0, :, begin : begin + size] for _, v in layer_kv]).cpu()
            names = {name: keys_by_resolution[name][chunk] for name in self.config.write}
            self._enqueue(functools.partial(self._write_chunk, names, keys, values))

    def _write_chunk(self, keys_by_resolution: dict[str, str], keys: torch.Tensor, values: torch.Tensor) -> None:
        for name, key in keys_by_resolution.items():
            if not self.store.contains(key):
                self.store.put(key, encode_chunk(RESOLUTIONS[name], keys, values))

    def _enqueue(self, job: Callable[[], None]) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="kvlab-prefix-write", daemon=True)
            self._writer.start()
        self._writes.put(job)

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            try:
                job()
            except Exception as error:  # noqa: BLE001 - saving is best effort
                if not self._write_failure_logged:
                    logger.warning("saving prefix chunks failed (%s: %s); generation is unaffected", type(error).__name__, error)
                    self._write_failure_logged = True
            finally:
                self._writes.task_done()
        self._writes.task_done()

    def flush(self) -> None:
        """Wait until every queued chunk is written (or failed)."""
        self._writes.join()

    def close(self) -> None:
        """Finish pending writes and stop the writer thread (the store stays open)."""
        if self._writer is not None and self._writer.is_alive():
            self._writes.put(None)
            self._writer.join()
        self._writer = None
