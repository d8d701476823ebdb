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
    include_stop_str_in_output: bool = dataclasses.field(
        default=False, metadata={"help": "keep the stop string that ended a row in its text (cut after it)"}
    )
    skip_special_tokens: bool = dataclasses.field(
        default=True, metadata={"help": "leave special tokens (end-of-sequence, chat markers) out of the text"}
    )
    min_tokens: int = dataclasses.field(
        default=0,
        metadata={"help": "end-of-sequence and stop tokens cannot be chosen before this many tokens are generated"},
    )
    stop_token_ids: tuple[int, ...] = dataclasses.field(
        default=(), metadata={"help": "token ids that end a row as end-of-sequence does (kept in its token ids)"}
    )
    logprobs: int | None = dataclasses.field(
        default=None,
        metadata={"help": "return each generated token's log-probability and this many most likely alternatives"},
    )
    prompt_logprobs: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "return each prompt token's log-probability (after the first) and this many most likely "
            "alternatives; the prompt is then computed, not restored from a prefix store"
        },
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
        if self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0 (alternatives per token) or None, got {value}")
        if any(token < 0 for token in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)}")
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
