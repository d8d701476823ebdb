"""Content keys of KV chunks: chained prefix hashes of token ids plus a fingerprint of what made them.

Chunk i's key hashes chunk i-1's key with chunk i's token ids, so a key names the whole prefix up to
the end of its chunk; the fingerprint (model, compressor, codec) keeps KV made differently apart.
SHA-256 throughout: stable across processes and machines (Python's `hash` is salted per process).

Without a salt, anyone who can list a store's keys can test whether a guessed prompt prefix was used
(hash the guess, look for the key). A namespace salt (`cache_salt`, as in OpenAI-compatible servers)
enters the fingerprint, so tenants with different salts share no keys and cannot probe each other's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np


def fingerprint(
    model: str, compressor: dict[str, Any] | None, codec: dict[str, Any] | None, salt: str | None = None
) -> str:
    """Hex digest identifying how a KV chunk was produced and encoded, and in which namespace (`salt`)."""
    described: dict[str, Any] = {"model": model, "compressor": compressor, "codec": codec}
    if salt is not None:
        described["salt"] = salt
    canonical = json.dumps(described, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def chunk_keys(token_ids: list[int], chunk_size: int, prefix_fingerprint: str) -> list[str]:
    """Keys of the complete chunks of `token_ids` (a trailing partial chunk gets none).

    Args:
        token_ids: The prompt's token ids.
        chunk_size: Tokens per chunk.
        prefix_fingerprint: `fingerprint(...)` of the model, compressor and codec.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    previous = bytes.fromhex(prefix_fingerprint)
    keys = []
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        tokens = np.asarray(token_ids[start : start + chunk_size], dtype="<i8").tobytes()
        previous = hashlib.sha256(previous + tokens).digest()
        keys.append(previous.hex())
    return keys
