"""The fetch pipeline: transfer chunks on one thread, decode on workers, restore in order, stop at a fault.

One thread transfers chunk i+1 while worker threads decode the chunks before it, and the caller
restores them in order. Before every chunk the rest is re-planned (`kvlab.store.prefix.planner`) from the
running measurements, so a link that slows down shifts the remaining chunks to smaller resolutions
or to recomputation. Each chunk is checked before it is restored: its size before it is read (no
larger than a chunk of the reader's geometry can encode to, `max_value_bytes`), its tag
(`kvlab.store.auth`), its frames against the reader's `ChunkGeometry` (before any allocation), and
its values for NaN and Inf.
Any exception on the way, from the store, a codec, a check or an allocation, ends the fetch at that
chunk and is returned as a `Fault`; worker exceptions reach the caller's thread through futures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvlab.codec import CodecError
from kvlab.store.auth import ChunkSealer
from kvlab.store.backends.base import KVStore
from kvlab.store.prefix.config import PrefixConfig
from kvlab.store.prefix.fetched import FetchedPrefix
from kvlab.store.prefix.planner import RECOMPUTE, ResolutionCost, plan_chunks
from kvlab.store.resolution import (
    RESOLUTIONS,
    ChunkGeometry,
    TokenRestore,
    decode_chunk,
    decode_chunk_by_token,
    max_chunk_bytes,
)
from kvlab.timing import Stopwatch

_Decoded = tuple[torch.Tensor, torch.Tensor, float, TokenRestore | None]
_Arrival = tuple[int, str, "Future[_Decoded] | None", int, float]
"""A transferred chunk: index, resolution, its decoding (None: the store had nothing), bytes, seconds."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    """Why a fetch ended early: the exception, the chunk index it stopped at and that chunk's key."""

    error: BaseException
    index: int
    key: str | None


class Estimates:
    """Running measurements the planner reads (exponentially weighted, guarded by a lock)."""

    def __init__(self, config: PrefixConfig) -> None:
        self.bandwidth = config.prior_bandwidth_bits / 8
        self.prefill_tokens_per_s = config.prior_prefill_tokens_per_s
        self.bits_per_value = {name: r.nominal_bits_per_value for name, r in RESOLUTIONS.items()}
        self.decode_s_per_value = {name: 1 / r.decode_values_per_s for name, r in RESOLUTIONS.items()}
        self.lock = threading.Lock()

    @staticmethod
    def _blend(old: float, new: float, weight: float = 0.5) -> float:
        return (1 - weight) * old + weight * new

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self.lock:
                self.bandwidth = self._blend(self.bandwidth, nbytes / seconds)

    def observe_decode(self, resolution: str, num_values: int, stored_bytes: int, seconds: float) -> None:
        """A chunk of `num_values` KV values (keys and values) came in `stored_bytes` and decoded in `seconds`."""
        if num_values > 0 and stored_bytes > 0 and seconds > 0:
            with self.lock:
                self.decode_s_per_value[resolution] = self._blend(self.decode_s_per_value[resolution],
                                                                  seconds / num_values)
                self.bits_per_value[resolution] = self._blend(self.bits_per_value[resolution],
                                                              8 * stored_bytes / num_values)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self.lock:
                self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, tokens / seconds)


class PrefixFetcher:
    """Plans and runs fetches for one `PrefixCache` (its config, measurements, sealer and geometry)."""

    def __init__(
        self, config: PrefixConfig, estimates: Estimates, sealer: ChunkSealer, geometry: ChunkGeometry,
        raw_bytes_per_token: int,
    ) -> None:
        self.config = config
        self.estimates = estimates
        self.sealer = sealer
        self.geometry = geometry
        self.raw_bytes_per_token = raw_bytes_per_token

    def max_value_bytes(self, name: str) -> int:
        """Largest stored value a chunk of this reader's geometry at resolution `name` can be, sealed."""
        return max_chunk_bytes(RESOLUTIONS[name], self.geometry) + self.sealer.overhead

    def plan(self, available: list[list[str]], allow_recompute: bool) -> list[str]:
        """Resolutions for the chunks whose stored resolutions `available` lists, from the current estimates."""
        # raw_bytes_per_token counts fp32 bytes: 4 per KV value.
        chunk_values = self.raw_bytes_per_token * self.config.chunk_tokens / 4
        with self.estimates.lock:
            bandwidth = self.estimates.bandwidth
            options = [
                [
                    ResolutionCost(
                        name,
                        RESOLUTIONS[name].quality,
                        chunk_values * self.estimates.bits_per_value[name] / 8,
                        chunk_values * self.estimates.decode_s_per_value[name] / self.config.decode_workers,
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

    def run(
        self,
        store: KVStore,
        keys: dict[str, list[str]],
        available: list[list[str]],
        indices: list[int],
        plan_cut: bool,
        fetched: FetchedPrefix,
    ) -> Fault | None:
        """Restore chunks `indices` into `fetched`, in order; stop at the planner's cut (when `plan_cut`)
        or at the first fault, which is returned."""
        arrivals: queue.Queue[_Arrival | BaseException | None] = queue.Queue(maxsize=self.config.decode_workers + 1)
        stop = threading.Event()
        decoders = ThreadPoolExecutor(self.config.decode_workers, thread_name_prefix="kvlab-prefix-decode")
        names: dict[int, str] = {}

        def transfer() -> None:
            try:
                for position, index in enumerate(indices):
                    if stop.is_set():
                        break
                    name = self.plan([available[i] for i in indices[position:]], plan_cut)[0]
                    if name == RECOMPUTE:
                        break
                    names[index] = name
                    key = keys[name][index]
                    clock = Stopwatch()
                    data = store.get(key, self.max_value_bytes(name))
                    seconds = clock.elapsed()
                    self.estimates.observe_transfer(len(data or b""), seconds)
                    decoding = None if data is None else decoders.submit(self.decode, name, key, data)
                    arrivals.put((index, name, decoding, len(data or b""), seconds))
            except BaseException as error:
                arrivals.put(error)
            finally:
                arrivals.put(None)

        thread = threading.Thread(target=transfer, name="kvlab-prefix-fetch", daemon=True)
        thread.start()
        try:
            return self._restore(arrivals, keys, names, indices, fetched)
        finally:
            stop.set()
            # Unblock the transfer thread if it waits on a full queue, then let it finish.
            while thread.is_alive():
                with contextlib.suppress(queue.Empty):
                    arrivals.get(timeout=0.05)
            thread.join()
            decoders.shutdown(wait=True, cancel_futures=True)

    def _restore(
        self,
        arrivals: queue.Queue[_Arrival | BaseException | None],
        keys: dict[str, list[str]],
        names: dict[int, str],
        indices: list[int],
        fetched: FetchedPrefix,
    ) -> Fault | None:
        stats = fetched.stats
        while (item := arrivals.get()) is not None:
            if isinstance(item, BaseException):
                index = indices[len(fetched.chunks)]
                return _fault(item, index, keys[names[index]][index] if index in names else None)
            index, name, decoding, nbytes, seconds = item
            key = keys[name][index]
            stats.transfer_s += seconds
            if decoding is None:
                return _fault(KeyError(f"chunk {index} ({name}) vanished from the store"), index, key)
            try:
                keys_tensor, values_tensor, decode_s, token_restore = decoding.result()
            except Exception as error:
                return Fault(error, index, key)
            stats.decode_s += decode_s
            if token_restore is not None:
                stats.peak_decode_buffer_bytes = max(stats.peak_decode_buffer_bytes, token_restore.peak_buffer_bytes)
                stats.token_restored_chunks += 1
                stats.restore_overlap += token_restore.restore_overlap
            stats.nbytes += nbytes
            stats.resolutions[name] = stats.resolutions.get(name, 0) + 1
            self.estimates.observe_decode(name, keys_tensor.numel() + values_tensor.numel(), nbytes, decode_s)
            fetched.chunks.append((keys_tensor, values_tensor))
            fetched.starts.append(index * self.config.chunk_tokens)
        return None

    def decode(self, name: str, key: str, data: bytes) -> _Decoded:
        """Keys and values of the value stored under `key` at resolution `name`, and the seconds it took.

        Raises:
            CodecError: The tag, a frame or the values are not what this reader accepts.
        """
        clock = Stopwatch()
        resolution, opened = RESOLUTIONS[name], self.sealer.open(key, data)
        token_restore = None
        if resolution.decodes_by_token:
            # Video-coded codes restore frame by frame: the buffer holds a few frames, not a decoded chunk.
            keys, values, token_restore = decode_chunk_by_token(resolution, opened, self.geometry)
        else:
            keys, values = decode_chunk(resolution, opened, self.geometry)
        for tensor in (keys, values):
            if not torch.isfinite(tensor).all():
                raise CodecError("stored chunk holds NaN or Inf")
        return keys, values, clock.elapsed(), token_restore


def _fault(error: BaseException, index: int, key: str | None) -> Fault:
    """A fault from the transfer side; interrupts and exits are not faults and go on up."""
    if not isinstance(error, Exception):
        raise error
    return Fault(error, index, key)
