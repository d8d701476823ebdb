"""What a generation request asks for."""

from __future__ import annotations

import dataclasses

from kvlab.cache.tiers import TierSpec
from kvlab.errors import ConfigError

# The sampling generator's seed range (torch takes a signed or unsigned 64-bit integer).
MIN_SEED = -(1 << 63)
MAX_SEED = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationConfig:
    """Decoding settings shared by plain, lossy and lossless generation (each field's help says what
    it does; `kvlab generate` shows the same text)."""

    max_new_tokens: int = dataclasses.field(
        default=256, metadata={"help": "upper limit on generated tokens per prompt"}
    )
    temperature: float = dataclasses.field(
        default=0.0, metadata={"help": "0 decodes greedily; above 0 samples from softmax(logits / temperature)"}
    )
    top_p: float = dataclasses.field(
        default=1.0,
        metadata={"help": "nucleus sampling: sample from the smallest set of tokens whose mass reaches top_p"},
    )
    seed: int = dataclasses.field(
        default=0, metadata={"help": "seed of the sampling generator (sampling is reproducible per seed and batch)"}
    )
    stop_strings: tuple[str, ...] = dataclasses.field(
        default=(),
        metadata={
            "help": "end a row once its text contains this; the text is cut before it (the token ids keep the "
            "token that completed it)"
        },
    )
    ignore_eos: bool = dataclasses.field(
        default=False, metadata={"help": "keep generating past end-of-sequence tokens (fixed-length measurements)"}
    )
    prefill_chunk_tokens: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "prefill the prompt in forwards cut at multiples of this many tokens (default: one forward); "
            "a prefix store prefills in its own chunks, so set this to its chunk size to get the same bits without one"
        },
    )
    full_kv_tier: str = dataclasses.field(
        default="memory",
        metadata={
            "help": "where the full KV lives while decoding: memory, host (pinned, copied on a side stream), disk "
            "(O_DIRECT reads) or emulated:GBPS (reads pass a GBPS GB/s token bucket); plain decoding reads it every "
            "step, lossless decoding once per verify"
        },
    )

    def __post_init__(self) -> None:
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be at least 1 or None, got {self.prefill_chunk_tokens}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not MIN_SEED <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be a 64-bit integer, from -2**63 to 2**64 - 1, got {self.seed}")
        TierSpec.parse(self.full_kv_tier)
        if any(not stop for stop in self.stop_strings):
            raise ConfigError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def tier(self) -> TierSpec:
        return TierSpec.parse(self.full_kv_tier)
