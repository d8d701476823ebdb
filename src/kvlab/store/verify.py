"""Checking what a store holds: every value sized, opened (tag, with a secret) and decoded in full.

`kvlab store verify URL` runs this over every key, so an operator finds corrupted, truncated, foreign,
forged, oversized or wrong-type values before readers trip over them one prompt at a time (readers
fall back to computing and rewrite the chunk, see `PrefixCache`). Each value is checked, and with
`delete` removed, on its own: one bad value never stops the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from kvlab.codec import CodecError, decode_frame
from kvlab.codec.framing import DEFAULT_MAX_DECODED_BYTES, MAX_HEADER_BYTES, PREFIX
from kvlab.store.auth import MAGIC, TAG_BYTES, ChunkSealer
from kvlab.store.backends.base import KVStore, StoredValueError
from kvlab.store.resolution import CHUNK_HEADER_BYTES, split_chunk

# Without a model the verifier cannot know a chunk's geometry; a value larger than two frames can be
# while each decodes within the decode limit (`decode_frame`'s default, 1 GiB) cannot be one it would
# accept: a frame holds at most its header and a payload of the decoded bytes plus zstd's worst-case
# expansion (1/256; 1/64 is allowed).
MAX_VALUE_BYTES = (len(MAGIC) + TAG_BYTES + CHUNK_HEADER_BYTES
                   + 2 * (PREFIX.size + MAX_HEADER_BYTES + DEFAULT_MAX_DECODED_BYTES + DEFAULT_MAX_DECODED_BYTES // 64))


@dataclasses.dataclass(frozen=True, slots=True)
class ValueCheck:
    """The verdict on one stored value: `problem` is None when it decodes cleanly.

    Attributes:
        nbytes: The value's size (None when the key holds no value the store can size).
        deleted: Whether the failed value was removed.
    """

    key: str
    nbytes: int | None
    problem: str | None = None
    deleted: bool = False

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
    store: KVStore,
    sealer: ChunkSealer,
    prefix: str = "",
    on_value: Callable[[ValueCheck], None] | None = None,
    delete: bool = False,
    max_bytes: int = MAX_VALUE_BYTES,
) -> Iterator[ValueCheck]:
    """Check every value under `prefix`, one at a time (a key removed meanwhile is skipped).

    Args:
        on_value: Called with each verdict (a progress bar).
        delete: Remove each value that fails, right after its check.
        max_bytes: Values larger than this fail unread (default: `MAX_VALUE_BYTES`).

    Raises:
        StoreUnavailableError: The store itself fails (a bad value never raises).
    """
    for key in store.keys(prefix):
        check = _check_key(store, sealer, key, max_bytes)
        if check is None:
            continue
        if delete and not check.ok:
            store.delete(key)
            check = dataclasses.replace(check, deleted=True)
        if on_value is not None:
            on_value(check)
        yield check


def _check_key(store: KVStore, sealer: ChunkSealer, key: str, max_bytes: int) -> ValueCheck | None:
    try:
        value = store.get(key, max_bytes)
    except StoredValueError as error:
        try:
            size = store.nbytes(key)
        except StoredValueError:
            size = None
        return ValueCheck(key, size, f"{type(error).__name__}: {error}")
    return None if value is None else check_value(key, value, sealer)
