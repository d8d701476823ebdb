"""What a generation request asks for."""

from __future__ import annotations

import dataclasses

from kvlab.cache.tiers import TierSpec
from kvlab.errors import ConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationConfig:
    """Decoding settings shared by plain, lossy and lossless generation.

    Attributes:
        max_new_tokens: Upper limit on generated tokens per prompt.
        temperature: 0 selects greedy decoding; above 0 samples from softmax(logits / temperature).
        top_p: Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p.
        seed: Seed of the sampling generator (sampling is reproducible for a given seed and batch).
        stop_strings: Generation of a row ends once its text contains one of these; the text is cut
            before it (the token ids keep the token that completed it).
        ignore_eos: Keep generating past end-of-sequence tokens (for fixed-length measurements).
        prefill_chunk_tokens: Prefill the prompt in forwards cut at multiples of this many tokens
            (None: one forward). A prefix store always prefills in its own chunks, so that a stored
            chunk has exactly the bits recomputing it gives; set this to the store's chunk size to get
            the same bits without a store.
        full_kv_tier: Where the full KV lives while decoding: "memory", "host", "disk" or
            "emulated:GBPS" (see `kvlab.cache.tiers`). Plain decoding reads it from there every step;
            lossless decoding once per verify.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    prefill_chunk_tokens: int | None = None
    full_kv_tier: str = "memory"

    def __post_init__(self) -> None:
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be at least 1 or None, got {self.prefill_chunk_tokens}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        TierSpec.parse(self.full_kv_tier)
        if any(not stop for stop in self.stop_strings):
            raise ConfigError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def tier(self) -> TierSpec:
        return TierSpec.parse(self.full_kv_tier)
