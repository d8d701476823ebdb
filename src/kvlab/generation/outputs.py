"""What generation returns: per-request outputs and the batch's timings and sizes (data, never printed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvlab.cache import KVCache
from kvlab.cache.tiers import TierStats
from kvlab.generation.logprobs import TokenLogprobs
from kvlab.generation.stopping import StopReason
from kvlab.store.prefix import FetchStats

ProgressCallback = Callable[[int], None]
"""Called after every decode step with the number of tokens that step produced (across rows)."""

TokenCallback = Callable[[int, list[int]], None]
"""Called with (request index, token ids) as a request's tokens are emitted, for streaming."""


@dataclasses.dataclass(slots=True)
class GenerationStats:
    """Timings and sizes of one `generate` call (a batch shares them).

    Attributes:
        prompt_tokens: Tokens prefilled, all rows together.
        new_tokens: Tokens generated, all rows together.
        ttft_s: Seconds from the call to the first generated token of every row (prefill included).
        decode_s: Seconds from the first token to the last.
        decode_tokens_per_s: Tokens generated after the first ones, per second of decoding.
        kv_bytes: Bytes of the KV representation at its largest (full-precision parts counted in fp16).
        kv_bytes_ratio: What the same tokens take uncompressed in fp16, divided by `kv_bytes`.
        kv_resident_bytes: Bytes of KV tensors held in memory at the largest, working copies included.
        prefix_reused_tokens: Prompt tokens whose KV came from a prefix store instead of the model.
        prefix_fetches: One record per prompt fetched from a prefix store.
        tier: The full-KV tier's name; `tier_bytes_read` bytes were loaded from it into fast memory,
            and forwards waited `tier_wait_s` seconds for loads.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    kv_bytes: int = 0
    kv_bytes_ratio: float = 1.0
    kv_resident_bytes: int = 0
    prefix_reused_tokens: int = 0
    prefix_fetches: list[FetchStats] = dataclasses.field(default_factory=list)
    tier: str = "memory"
    tier_bytes_read: int = 0
    tier_wait_s: float = 0.0

    def record_cache(self, cache: KVCache) -> None:
        """Update the KV size figures from the cache's current contents, keeping the largest."""
        self.record_caches([cache])

    def record_caches(self, caches: list[KVCache]) -> None:
        """`record_cache` for a batch whose rows live in separate caches (figures are summed)."""
        stored = sum(cache.nbytes() for cache in caches)
        if stored >= self.kv_bytes:
            self.kv_bytes = stored
            self.kv_bytes_ratio = sum(cache.full_nbytes() for cache in caches) / stored if stored else 1.0
        self.kv_resident_bytes = max(self.kv_resident_bytes, sum(cache.resident_bytes() for cache in caches))

    def record_tier(self, stats: TierStats) -> None:
        self.tier_bytes_read = stats.bytes_read
        self.tier_wait_s = stats.wait_s


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """What one prompt of a batch produced.

    Attributes:
        prompt_token_ids: Exactly the ids the model was fed.
        token_ids: Generated ids, including a final end-of-sequence token when generation hit one.
        text: Decoded `token_ids` without special tokens, cut before a stop string.
        stop_reason: "eos", "stop_string", "length", "cancelled", or "error" when something failed the
            request (its tokens and text are then only what it produced before failing: not an answer).
        logprobs: Scores of `token_ids`, when `GenerationConfig.logprobs` asked for them.
        prompt_logprobs: Scores of the prompt's tokens after the first, when
            `GenerationConfig.prompt_logprobs` asked for them.
        error: What failed the request, as "<ExceptionType>: <message>" (None unless `stop_reason` is
            "error").
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    stop_reason: StopReason
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    error: str | None = None


@dataclasses.dataclass(slots=True)
class GenerationOutput:
    """Outputs of a batch (lossless decoding returns a subclass that adds its draft/verify statistics)."""

    requests: list[RequestOutput]
    stats: GenerationStats


def finish_timing(stats: GenerationStats, total_s: float, num_rows: int) -> None:
    stats.decode_s = total_s - stats.ttft_s
    decoded_after_first = stats.new_tokens - num_rows
    stats.decode_tokens_per_s = decoded_after_first / stats.decode_s if stats.decode_s > 0 else 0.0
