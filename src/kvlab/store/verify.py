"""Checking what a store holds: every value opened (tag, with a secret) and decoded in full.

`kvlab store verify URL` runs this over every key, so an operator finds corrupted, truncated, foreign
or forged values before readers trip over them one prompt at a time (readers fall back to computing
and rewrite the chunk, see `PrefixCache`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from kvlab.codec import CodecError, decode_frame
from kvlab.store.auth import ChunkSealer
from kvlab.store.base import KVStore
from kvlab.store.resolution import split_chunk


@dataclasses.dataclass(frozen=True, slots=True)
class ValueCheck:
    """The verdict on one stored value: `problem` is None when it decodes cleanly."""

    key: str
    nbytes: int
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


def check_value(key: str, value: bytes, sealer: ChunkSealer) -> ValueCheck:
    """Open `value` (its tag, when `sealer` has a secret) and decode both of its frames."""
    try:
        key_frame, value_frame = split_chunk(sealer.open(key, value))
        keys, values = decode_frame(key_frame), decode_frame(value_frame)
        if keys.shape != values.shape:
            raise CodecError(f"keys {tuple(keys.shape)} but values {tuple(values.shape)}")
        if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
            raise CodecError("holds NaN or Inf")
    except CodecError as error:
        return ValueCheck(key, len(value), f"{type(error).__name__}: {error}")
    return ValueCheck(key, len(value))


def verify_store(
    store: KVStore, sealer: ChunkSealer, prefix: str = "", on_value: Callable[[ValueCheck], None] | None = None
) -> Iterator[ValueCheck]:
    """Check every value under `prefix`, one at a time (a key removed meanwhile is skipped)."""
    for key in store.keys(prefix):
        value = store.get(key)
        if value is None:
            continue
        check = check_value(key, value, sealer)
        if on_value is not None:
            on_value(check)
        yield check
