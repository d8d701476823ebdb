"""Where the full KV lives, and what reading it costs.

VeriCache keeps the full KV off the fast tier: plain decoding must read all of it every step, while
lossless decoding reads a row's full KV once per verify and drafts from a small cache in fast memory.
A tier makes that cost real:

- `memory`: the cache stays where it is (no tier; reads cost what memory reads cost).
- `host`: the full KV's home is host memory (pinned when the model runs on a GPU: the paper's
  setting); every read copies the row's stored tokens to the model's device first.
- `disk`: the home is one preallocated file per layer, read with O_DIRECT so every read really
  reaches storage (where the file system refuses O_DIRECT, pages are dropped after each read).
  Every token written keeps a checksum in memory, checked on every read: a file changed under a
  running decode (overwritten, truncated and re-extended) raises `TierError`, never changes output.
- `emulated:GBPS`: reads pass through a token bucket of GBPS gigabytes per second (an emulation,
  labelled as such, for reproducible experiments); the data itself stays in memory.

A tiered layer's stored tokens are readable for one forward after a load: `TierLoader.request`
queues loads on a background thread (so they overlap with other work), and a forward that reads a
row that was not requested loads it on the spot. Writes of new tokens go through to the home copy
and are not charged (they are q tokens, against the T a read moves).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from kvlab.bandwidth import TokenBucket
from kvlab.cache.kv_cache import FullKVLayer, KVCache
from kvlab.cache.tier_storage import DiskStorage, EmulatedStorage, HostStorage, TierError, TierStorage
from kvlab.errors import ConfigError
from kvlab.paths import cache_dir
from kvlab.timing import Stopwatch

TIER_KINDS = ("memory", "host", "disk", "emulated")
_ALIGN = 4096
_DIR_PREFIX = "kvlab-tier-"
# Bytes an idle emulated link may save up (a small burst, so reads cost their bandwidth).
EMULATED_BURST_BYTES = 64 * 1024



@dataclasses.dataclass(frozen=True, slots=True)
class TierSpec:
    """A full-KV tier, parsed from its name: memory, host, disk, or emulated:GBPS.

    Attributes:
        kind: One of `TIER_KINDS`.
        gigabytes_per_s: Bandwidth of an emulated tier (10^9 bytes per second).
        directory: Parent directory of a disk tier's files (default: `$KVLAB_TIER_DIR`, else the
            kvlab cache directory; it must be on a real disk, not tmpfs, for O_DIRECT).
    """

    kind: str = "memory"
    gigabytes_per_s: float | None = None
    directory: Path | None = None

    @classmethod
    def parse(cls, name: str) -> TierSpec:
        match = re.fullmatch(r"emulated:(\d+(?:\.\d+)?)", name)
        if match:
            rate = float(match.group(1))
            if rate <= 0:
                raise ConfigError(f"an emulated tier needs a positive bandwidth in GB/s, got {name!r}")
            return cls("emulated", rate)
        if name not in TIER_KINDS or name == "emulated":
            raise ConfigError(
                f"full KV tier must be memory, host, disk or emulated:GBPS (e.g. emulated:2), got {name!r}"
            )
        return cls(name)

    @property
    def name(self) -> str:
        return f"emulated:{self.gigabytes_per_s:g}" if self.kind == "emulated" else self.kind


@dataclasses.dataclass(slots=True)
class TierStats:
    """What a tier's reads cost: `bytes_read` loaded into fast memory in `load_s` of loading, `wait_s`
    forwards spent waiting."""

    bytes_read: int = 0
    loads: int = 0
    wait_s: float = 0.0
    load_s: float = 0.0


class TieredKVLayer(FullKVLayer):
    """A full layer whose fast buffers are only valid for one forward after each load from `storage`.

    The buffers inherited from `FullKVLayer` are the fast copy attention reads. The capacity is fixed
    at creation (the home copy is preallocated).
    """

    def __init__(
        self,
        storage: TierStorage,
        loader: TierLoader,
        source: FullKVLayer,
        capacity: int,
    ) -> None:
        batch, heads, _, dim = source.keys.shape
        super().__init__(batch, heads, dim, capacity, source.keys.dtype, source.keys.device, source.sliding_window)
        self.storage = storage
        self.loader = loader
        self.slots = list(range(batch))
        self.pending: list[Future[None] | None] = [None] * batch
        for row in range(batch):
            keys, values = source.stored(row)
            self.copy_row_from(source, row, row)
            storage.write(row, 0, keys, values)

    def request(self, row: int) -> None:
        """Queue a load of row `row` for the next forward (no-op when one is queued)."""
        if self.pending[row] is None:
            self.pending[row] = self.loader.submit(self._load, row, self.slots[row], self.lengths[row])

    def load_bytes(self, row: int) -> int:
        """Bytes the next load of row `row` moves over the link: its stored keys and values as held (a
        float32 model's 4 bytes an element, not `nbytes`'s fp16 convention)."""
        length = self.lengths[row]
        return self.keys[row, :, :length].nbytes + self.values[row, :, :length].nbytes

    def _load(self, row: int, slot: int, length: int) -> None:
        clock = Stopwatch()
        moved = self.storage.load(slot, length, self.keys[row, :, :length], self.values[row, :, :length])
        self.loader.record(moved, clock.elapsed())

    def _await(self, rows: list[int], consume: bool) -> None:
        for row in rows:
            self.request(row)
            future = self.pending[row]
            assert future is not None
            waited, clock = not future.done(), Stopwatch()
            future.result()  # re-raises what failed on the loader thread
            if waited:
                self.loader.stats.wait_s += clock.elapsed()
            if consume:
                self.pending[row] = None

    def append(self, new_keys: torch.Tensor, new_values: torch.Tensor, counts: list[int] | None = None) -> None:
        rows = list(range(len(self.lengths)))
        self._await(rows, consume=False)
        starts = list(self.lengths)
        super().append(new_keys, new_values, counts)
        for row in rows:
            count = self.lengths[row] - starts[row]
            self.storage.write(self.slots[row], starts[row], new_keys[row, :, :count], new_values[row, :, :count])

    def attend(
        self, queries: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> torch.Tensor:
        self._await(list(range(len(self.lengths))), consume=True)
        return super().attend(queries, query_positions, scaling, softcap)

    def attend_newest(
        self, queries: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> torch.Tensor:
        self._await([0], consume=True)
        return FullKVLayer.attend_newest(self, queries, query_positions, scaling, softcap)

    def newest_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        views = self._newest_views()
        if views is not None:  # the row's full KV has landed in the buffers the views show
            self._await([0], consume=True)
        return views

    def select_rows(self, rows: list[int]) -> None:
        super().select_rows(rows)
        self.slots = [self.slots[row] for row in rows]
        self.pending = [self.pending[row] for row in rows]

    def _reserve(self, needed: int) -> None:
        if needed > self.capacity:
            raise TierError(f"the full-KV tier holds {self.capacity} tokens per row; {needed} were needed")

    def empty_like(self, batch_size: int, capacity: int) -> FullKVLayer:
        raise TierError("a tiered cache cannot be stacked; move the stacked cache to the tier instead")


class TierLoader:
    """The one background thread that moves full KV from a tier to fast memory (one link, one queue)."""

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.stats = TierStats()
        self.bucket = TokenBucket(spec.gigabytes_per_s * 1e9, EMULATED_BURST_BYTES) if spec.gigabytes_per_s else None
        self._executor = (
            None if spec.kind == "memory" else ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-tier")
        )
        self._lock = threading.Lock()
        self._files = itertools.count()
        self.directory: Path | None = None
        if spec.kind == "disk":
            self.directory = _new_tier_directory(spec.directory)
            weakref.finalize(self, shutil.rmtree, self.directory, True)
        if self._executor is not None:
            weakref.finalize(self, self._executor.shutdown, False)

    def submit(self, function: Callable[..., None], *args: object) -> Future[None]:
        assert self._executor is not None, "a memory tier loads nothing"
        return self._executor.submit(function, *args)

    def record(self, moved: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.stats.bytes_read += moved
            self.stats.loads += 1
            self.stats.load_s += seconds

    def bytes_per_s(self) -> float | None:
        """The link's rate: declared for an emulated tier, else measured over the loads so far (None before
        any, and for the memory tier, which has no link)."""
        if self.spec.kind == "memory":
            return None
        if self.spec.gigabytes_per_s is not None:
            return self.spec.gigabytes_per_s * 1e9
        return self.stats.bytes_read / self.stats.load_s if self.stats.load_s > 0 else None

    def storage(
        self, layer_idx: int, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device
    ) -> TierStorage:
        if self.spec.kind == "emulated":
            assert self.bucket is not None
            return EmulatedStorage(self.bucket)
        if self.spec.kind == "host":
            return HostStorage(shape, dtype, pin=device.type == "cuda")
        assert self.directory is not None
        return DiskStorage(self.directory / f"layer-{layer_idx:03d}-{next(self._files)}.kv", shape, dtype)


def move_to_tier(cache: KVCache, loader: TierLoader, capacity: int) -> KVCache:
    """A copy of a full cache whose layers live on `loader`'s tier (the input cache is left as it is).

    Args:
        cache: A cache of `FullKVLayer`s.
        loader: The tier and its link (share one loader between caches that share the link).
        capacity: Tokens per row the tier must hold (fixed: the home copy is preallocated).
    """
    if loader.spec.kind == "memory":
        return cache
    layers = []
    for index, layer in enumerate(cache.layers):
        if type(layer) is not FullKVLayer:
            raise ConfigError("only a full (uncompressed) cache can live on a slower tier")
        batch, heads, _, dim = layer.keys.shape
        storage = loader.storage(index, (batch, heads, capacity, dim), layer.keys.dtype, layer.keys.device)
        layers.append(TieredKVLayer(storage, loader, layer, capacity))
    return KVCache(layers, cache.seq_lengths)  # type: ignore[arg-type]


def request_loads(cache: KVCache, rows: list[int] | None = None) -> None:
    """Queue loads of `rows` (default: all) of every tiered layer, layer by layer, so a forward that
    starts now finds its first layers loaded while later ones are still coming (no-op in memory)."""
    selected = range(cache.batch_size) if rows is None else rows
    for layer in cache.layers:
        if isinstance(layer, TieredKVLayer):
            for row in selected:
                layer.request(row)


def _new_tier_directory(parent: Path | None) -> Path:
    base = parent or Path(os.environ.get("KVLAB_TIER_DIR") or cache_dir() / "tiers")
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    _remove_stale_directories(base)
    return Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=base))


def _remove_stale_directories(base: Path) -> None:
    """Delete tier directories left by processes that died (they hold plaintext prompt KV)."""
    for entry in base.glob(f"{_DIR_PREFIX}*"):
        match = re.match(rf"{_DIR_PREFIX}(\d+)-", entry.name)
        if match and not _process_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

