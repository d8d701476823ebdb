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

import abc
import dataclasses
import itertools
import mmap
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
from kvlab.errors import ConfigError, KvlabError
from kvlab.paths import cache_dir
from kvlab.timing import Stopwatch

TIER_KINDS = ("memory", "host", "disk", "emulated")
_ALIGN = 4096
_DIR_PREFIX = "kvlab-tier-"
# Bytes an idle emulated link may save up (a small burst, so reads cost their bandwidth).
EMULATED_BURST_BYTES = 64 * 1024


class TierError(KvlabError):
    """A tier could not hold or deliver the KV (disk full, file truncated, link fault)."""


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
    """What a tier's reads cost: `bytes_read` loaded into fast memory, `wait_s` forwards spent waiting."""

    bytes_read: int = 0
    loads: int = 0
    wait_s: float = 0.0


class TierStorage(abc.ABC):
    """The home copy of one layer's keys/values, addressed by slot (a row's place at creation)."""

    @abc.abstractmethod
    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store [H_kv, q, D] keys/values of slot `slot` at token `start`."""

    @abc.abstractmethod
    def load(self, slot: int, length: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Bring the first `length` tokens of `slot` into `keys`/`values` ([H_kv, length, D] views of
        fast memory); returns the bytes moved."""


class HostStorage(TierStorage):
    """Home in host memory (pinned for a GPU); a load copies to the device of the fast buffers."""

    def __init__(self, shape: tuple[int, int, int, int], dtype: torch.dtype, pin: bool) -> None:
        self.keys = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.values = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self._stream = torch.cuda.Stream() if pin else None

    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys[slot, :, start : start + keys.shape[1]] = keys.to("cpu")
        self.values[slot, :, start : start + values.shape[1]] = values.to("cpu")

    def load(self, slot: int, length: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        if self._stream is None:
            keys.copy_(self.keys[slot, :, :length])
            values.copy_(self.values[slot, :, :length])
        else:
            with torch.cuda.stream(self._stream):
                keys.copy_(self.keys[slot, :, :length], non_blocking=True)
                values.copy_(self.values[slot, :, :length], non_blocking=True)
            self._stream.synchronize()
        return keys.nbytes + values.nbytes


class EmulatedStorage(TierStorage):
    """No separate copy: a load only waits as long as moving the bytes over the link would take."""

    def __init__(self, bucket: TokenBucket) -> None:
        self.bucket = bucket

    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        pass

    def load(self, slot: int, length: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        size = keys.nbytes + values.nbytes
        self.bucket.take(size)
        return size


class DiskStorage(TierStorage):
    """One preallocated file per layer: [slot][keys | values][head][capacity][D], read with O_DIRECT.

    Each (slot, head) region starts on a 4096-byte boundary, so a direct read of it needs no
    realignment; reads land in a page-aligned bounce buffer and are copied into the fast buffers.

    Integrity: each token's bytes, read as int16 words, have a weighted sum (`_token_sums`) kept in
    memory for every token written and recomputed on every read. It is one matrix-vector product
    over bytes the read already brought into the bounce buffer (no second pass over storage, no
    per-token Python), held in 8 bytes per token and head against the token's `2 D` or `4 D`; file
    identity or size checks would miss an overwrite in place, and mtimes tick too coarsely to tell a
    foreign write from our own. The weights are drawn at random per file, so a change that keeps
    every sum needs knowing them; any change of a single word always shows.
    """

    def __init__(self, path: Path, shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
        slots, heads, capacity, dim = shape
        self.path = path
        self.dtype = dtype
        self.token_bytes = dim * torch.empty((), dtype=dtype).element_size()
        self.head_bytes = _round_up(capacity * self.token_bytes, _ALIGN)
        self.heads = heads
        assert self.token_bytes % 2 == 0, "KV dtypes are 2 or 4 bytes wide"
        # Products of an int16 word and a weight below 2**16 stay below 2**31, so float64 sums of up to
        # 2**22 words per token are exact integers.
        self._weights = torch.randint(1, 2**16, (self.token_bytes // 2,), dtype=torch.int64).to(torch.float64)
        self._sums = torch.zeros((slots, 2, heads, capacity), dtype=torch.float64)
        total = slots * 2 * heads * self.head_bytes
        self._write_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(self._write_fd, 0, total)
        except OSError as error:
            os.close(self._write_fd)
            path.unlink(missing_ok=True)
            free = shutil.disk_usage(path.parent).free
            raise TierError(
                f"cannot reserve {_amount(total)} for one layer of the disk tier in {path.parent} ({error.strerror}; "
                f"{_amount(free)} free there): free space there or set KVLAB_TIER_DIR to a larger disk"
            ) from None
        self.direct = True
        try:
            self._read_fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:
            # tmpfs and some other file systems refuse O_DIRECT: drop pages after each read instead.
            self.direct = False
            self._read_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._bounce = mmap.mmap(-1, self.head_bytes)
        self._bounce_tensor = torch.frombuffer(self._bounce, dtype=torch.uint8)
        self._closer = weakref.finalize(self, _close_all, [self._write_fd, self._read_fd])

    def _offset(self, slot: int, part: int, head: int) -> int:
        return ((slot * 2 + part) * self.heads + head) * self.head_bytes

    def _token_sums(self, raw: torch.Tensor, length: int) -> torch.Tensor:
        """[length] checksums of `length` tokens' bytes `raw` (uint8, contiguous)."""
        return raw.view(torch.int16).view(length, -1).to(torch.float64) @ self._weights

    def _check(self, read: torch.Tensor, slot: int, part: int, head: int, length: int) -> None:
        """TierError unless the `length` tokens just read are the bytes written there."""
        differ = (self._token_sums(read, length) != self._sums[slot, part, head, :length]).nonzero()
        if len(differ):
            raise TierError(
                f"the disk tier file {self.path} changed under the decode (the {('keys', 'values')[part]} of head "
                f"{head}, slot {slot}, differ from what was written from token {int(differ[0])} on): something else "
                "wrote to it; rerun, and keep the tier directory private to this process"
            )

    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        for part, tensor in enumerate((keys, values)):
            data = tensor.to("cpu").contiguous()
            length = data.shape[1]
            for head in range(self.heads):
                raw_tensor = data[head].reshape(-1).view(torch.uint8)
                raw = raw_tensor.numpy().tobytes()
                offset = self._offset(slot, part, head) + start * self.token_bytes
                if os.pwrite(self._write_fd, raw, offset) != len(raw):
                    raise TierError("short write to the disk tier: the disk is full or failing")
                if length:
                    self._sums[slot, part, head, start : start + length] = self._token_sums(raw_tensor, length)

    def load(self, slot: int, length: int, keys: torch.Tensor, values: torch.Tensor) -> int:
        size = length * self.token_bytes
        read_size = _round_up(size, _ALIGN) if self.direct else size
        moved = 0
        for part, target in enumerate((keys, values)):
            for head in range(self.heads):
                offset = self._offset(slot, part, head)
                view = memoryview(self._bounce)[:read_size]
                got = os.preadv(self._read_fd, [view], offset)
                if got < size:
                    raise TierError(f"the disk tier file ends early ({got} of {size} bytes): it was truncated")
                if not self.direct:
                    os.posix_fadvise(self._read_fd, offset, read_size, os.POSIX_FADV_DONTNEED)
                read = self._bounce_tensor[:size]
                if length:
                    self._check(read, slot, part, head, length)
                target[head].copy_(read.view(self.dtype).view(length, -1))
                moved += size
        return moved


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

    def _load(self, row: int, slot: int, length: int) -> None:
        moved = self.storage.load(slot, length, self.keys[row, :, :length], self.values[row, :, :length])
        self.loader.record(moved)

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

    def record(self, moved: int) -> None:
        with self._lock:
            self.stats.bytes_read += moved
            self.stats.loads += 1

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


def _amount(num_bytes: int) -> str:
    """`num_bytes` in the largest binary unit that keeps it at least 1 (12.0 MiB, 3.50 GiB, 512 bytes)."""
    for unit, power in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << power:
            return f"{num_bytes / (1 << power):.2f} {unit}"
    return f"{num_bytes} bytes"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
