"""The homes a tiered layer's full KV lives in: host memory, a file read with O_DIRECT, an emulated link.

Each implements `write` (new tokens go through to the home copy) and `load` (a row's stored tokens
back to the fast buffers the forward reads). The disk home checks a checksum per token written on
every read, so a file changed under a running decode raises `TierError`.
"""

from __future__ import annotations

import abc
import mmap
import os
import shutil
import weakref
from pathlib import Path

import torch

from kvlab.bandwidth import TokenBucket
from kvlab.errors import KvlabError

_ALIGN = 4096

class TierError(KvlabError):
    """A tier could not hold or deliver the KV (disk full, file truncated, link fault)."""



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
