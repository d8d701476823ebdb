"""What a prefix fetch returns: the restored chunks and what the fetch did."""

from __future__ import annotations

import dataclasses

import torch

from kvlab.cache import KVCache


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
        failed_key: The store key of the chunk it stopped at (None: it stopped at the lookup, or did not stop).
        faults: Faults met (0 or 1: the first one ends the fetch); `PrefixCache.fault_counts` sums them by kind.
        peak_decode_buffer_bytes: Most bytes one chunk's decoding held besides its output, for chunks
            restored token by token (`resolution.decode_chunk_by_token`); 0 when none was.
        token_restored_chunks: Chunks restored token by token.
        restore_overlap: Summed over those chunks, the share of each decode during which restored
            tokens were already in place (divide by `token_restored_chunks` for the mean).
    """

    stored_tokens: int = 0
    fetched_tokens: int = 0
    nbytes: int = 0
    fetch_s: float = 0.0
    transfer_s: float = 0.0
    decode_s: float = 0.0
    resolutions: dict[str, int] = dataclasses.field(default_factory=dict)
    failure: str | None = None
    failed_key: str | None = None
    faults: int = 0
    peak_decode_buffer_bytes: int = 0
    token_restored_chunks: int = 0
    restore_overlap: float = 0.0


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
        cache.restore_chunks(self.starts, self.chunks, device)
