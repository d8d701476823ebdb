"""Where the full KV lives: in memory (default) or in memory-mapped files on disk.

A disk-tier layer keeps its key/value buffers in per-layer files mapped into memory, so attention
reads them straight from the mapping and the operating system pages them in from storage. Before a
verify pass, `prefetch()` pulls the stored region in (the KV "load" of the VeriCache design); run in a
background thread, it overlaps with drafting from the compressed cache.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from kvlab.cache.kv_cache import FullKVLayer, KVCache
from kvlab.timing import Stopwatch

Tier = Literal["memory", "disk"]
TIERS: tuple[Tier, ...] = ("memory", "disk")

# numpy has no bfloat16: such buffers are mapped as int16 and viewed back as bfloat16.
_NUMPY_STORAGE = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}
_PAGE_BYTES = 4096


class DiskKVLayer(FullKVLayer):
    """A `FullKVLayer` whose buffers are memory-mapped files under `directory`."""

    def __init__(
        self,
        directory: Path,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> None:
        self.directory = directory
        weakref.finalize(self, shutil.rmtree, directory, True)
        self._generation = 0
        self.sliding_window = sliding_window
        self.lengths = [0] * batch_size
        self.keys, self.values = self._mapped_pair((batch_size, num_kv_heads, max(capacity, 1), head_dim), dtype)

    def _mapped_pair(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self._generation += 1
        pair = []
        for name in ("keys", "values"):
            path = self.directory / f"{name}.{self._generation}.bin"
            # A fresh file reads as zeros, which masked attention needs in unused slots.
            array = np.memmap(path, dtype=_NUMPY_STORAGE[dtype], mode="w+", shape=shape)
            tensor = torch.from_numpy(array)
            pair.append(tensor.view(dtype) if dtype == torch.bfloat16 else tensor)
        for name in ("keys", "values"):
            stale = self.directory / f"{name}.{self._generation - 1}.bin"
            stale.unlink(missing_ok=True)
        return pair[0], pair[1]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        self._remap(list(range(len(self.lengths))), max(needed, 2 * self.capacity))

    def select_rows(self, rows: list[int]) -> None:
        self._remap(rows, self.capacity)
        self.lengths = [self.lengths[row] for row in rows]

    def _remap(self, rows: list[int], capacity: int) -> None:
        old_keys, old_values = self.keys, self.values
        shape = (len(rows), old_keys.shape[1], capacity, old_keys.shape[3])
        self.keys, self.values = self._mapped_pair(shape, old_keys.dtype)
        used = min(old_keys.shape[2], capacity)
        for new_row, row in enumerate(rows):
            self.keys[new_row, :, :used] = old_keys[row, :, :used]
            self.values[new_row, :, :used] = old_values[row, :, :used]

    def prefetch(self) -> None:
        """Read one element per page of every stored token range, pulling the pages into memory."""
        stride = max(1, _PAGE_BYTES // (self.keys.shape[3] * self.keys.element_size()))
        for buffer in (self.keys, self.values):
            for row, length in enumerate(self.lengths):
                buffer[row, :, :length:stride, 0].sum()

    def empty_like(self, batch_size: int, capacity: int) -> DiskKVLayer:
        directory = Path(tempfile.mkdtemp(prefix="layer-", dir=self.directory.parent))
        return DiskKVLayer(
            directory, batch_size, self.keys.shape[1], self.keys.shape[3], capacity, self.keys.dtype, self.sliding_window
        )


def move_to_disk(cache: KVCache, directory: Path | None = None) -> KVCache:
    """A copy of a full cache whose layers live in memory-mapped files (removed with the cache).

    Args:
        cache: A cache of `FullKVLayer`s.
        directory: Parent directory for the files (default: a new temporary directory).
    """
    root = Path(tempfile.mkdtemp(prefix="kvlab-full-kv-", dir=directory))
    layers = []
    for index, layer in enumerate(cache.layers):
        assert isinstance(layer, FullKVLayer)
        layer_dir = Path(tempfile.mkdtemp(prefix=f"layer-{index:03d}-", dir=root))
        batch, heads, capacity, dim = layer.keys.shape
        disk = DiskKVLayer(layer_dir, batch, heads, dim, capacity, layer.keys.dtype, layer.sliding_window)
        for row in range(batch):
            disk.copy_row_from(layer, row, row)
        layers.append(disk)
    moved = KVCache(layers, cache.seq_lengths)  # type: ignore[arg-type]
    weakref.finalize(moved, shutil.rmtree, root, True)
    return moved


def prefetch(cache: KVCache) -> None:
    """Pull every disk-tier layer's stored tokens into memory (no-op for memory layers)."""
    for layer in cache.layers:
        if isinstance(layer, DiskKVLayer):
            layer.prefetch()


class BackgroundLoader:
    """Runs `prefetch(cache)` on a thread; `wait()` returns the seconds the caller had to wait."""

    def __init__(self, cache: KVCache) -> None:
        self._thread = threading.Thread(target=prefetch, args=(cache,), daemon=True)
        self._thread.start()

    def wait(self) -> float:
        clock = Stopwatch()
        self._thread.join()
        return clock.elapsed()
