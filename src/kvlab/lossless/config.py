"""How lossless decoding drafts and verifies."""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import torch

from kvlab.compress import Compressor
from kvlab.errors import ConfigError
from kvlab.lossless.prompt_lookup import NGRAM_PREFIX, PromptLookup
from kvlab.models.draft_weights import DRAFT_WEIGHTS, DraftWeights
from kvlab.store.resolution import RESOLUTIONS, get_resolution

logger = logging.getLogger(__name__)

Schedule = Literal["staggered", "synchronous"]
SCHEDULES: tuple[Schedule, ...] = ("staggered", "synchronous")

INEXACT_REASON = (
    "greedy output equals plain decoding only in float32: in bfloat16/float16 a verify forward over k tokens "
    "rounds differently from k single steps, so tokens may differ"
)
_inexact_warned = False


@dataclasses.dataclass(frozen=True, slots=True)
class LosslessConfig:
    """How to draft and verify (where the full KV lives is `GenerationConfig.full_kv_tier`; each
    field's help says what it does, and `kvlab generate` shows the same text).

    Greedy output is token-identical to plain full-KV decoding when the model runs in float32
    (`lossless_exact`). In bfloat16/float16 it is not guaranteed: a verify forward over k tokens
    rounds differently from k single-token steps, so an argmax can flip and the tokens from there on
    differ; the engine logs a warning once per process.
    """

    drafter: Compressor = dataclasses.field(
        metadata={"help": "the compressor whose cache drafts (any registered method)"}
    )
    num_draft_tokens: int | Literal["auto"] = dataclasses.field(
        default="auto",
        metadata={
            "help": "tokens drafted per round, or auto: each round the planner picks the drafter and length (or "
            "a plain step) with the most expected tokens per second, from the sequence's acceptance per draft "
            "position and a cost model fitted to this machine's forwards"
        },
    )
    max_num_draft_tokens: int = dataclasses.field(
        default=64, metadata={"help": "upper bound of adaptive draft lengths"}
    )
    schedule: Schedule = dataclasses.field(
        default="staggered",
        metadata={
            "help": "staggered queues a sequence's full-KV load when its round starts, so it overlaps drafting; "
            "synchronous loads it when the verify forward runs"
        },
    )
    draft_weights: DraftWeights = dataclasses.field(
        default="same",
        metadata={
            "help": "draft with the model itself (same) or a cheaper bf16/int8/int4-weight copy; verification always "
            "uses the exact model"
        },
    )
    prompt_lookup: PromptLookup | None = dataclasses.field(
        default=None,
        metadata={
            "help": "also draft by prompt lookup (the `ngram+` drafters): a round takes what followed the context's "
            "last tokens before, at no forward, when that is expected to pay more than the compressed cache"
        },
    )
    prefix_draft: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "with a prefix store: fetch the prefix at this low-bit resolution (int8, int4, int4-video, ...) "
            "first and draft from it while the bit-exact prefix transfers"
        },
    )
    prefix_draft_chunks: int | None = dataclasses.field(
        default=4,
        metadata={
            "help": "low-bit chunks the drafter gets: the first (attention sinks) and the last ones, so the extra "
            "transfer stays small (None: every stored chunk)"
        },
    )

    def __post_init__(self) -> None:
        if self.num_draft_tokens != "auto" and (
            not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1
        ):
            raise ConfigError(f"num_draft_tokens must be a positive integer or 'auto', got {self.num_draft_tokens!r}")
        if self.max_num_draft_tokens < 1:
            raise ConfigError(f"max_num_draft_tokens must be at least 1, got {self.max_num_draft_tokens}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ConfigError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {self.draft_weights!r}")
        if self.prefix_draft is not None and get_resolution(self.prefix_draft).exact:
            low_bit = ", ".join(name for name, resolution in RESOLUTIONS.items() if not resolution.exact)
            raise ConfigError(
                f"prefix_draft is the low-bit resolution to draft from, not {self.prefix_draft!r}: use one of {low_bit}"
            )
        if self.prefix_draft_chunks is not None and self.prefix_draft_chunks < 1:
            raise ConfigError(f"prefix_draft_chunks must be at least 1 or None, got {self.prefix_draft_chunks}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")

    @property
    def drafter_name(self) -> str:
        """The drafter's name as `--drafter` takes it (`ngram+snapkv` with prompt lookup)."""
        name = str(type(self.drafter).registry_name)  # type: ignore[attr-defined]
        return NGRAM_PREFIX + name if self.prompt_lookup is not None else name


def lossless_exact(dtype: torch.dtype) -> bool:
    """Whether greedy lossless decoding of a model in `dtype` is token-identical to plain decoding:
    only in float32 (see `INEXACT_REASON`)."""
    return dtype == torch.float32


def warn_if_inexact(dtype: torch.dtype) -> None:
    """Log, once per process, that lossless decoding of a model in `dtype` may change tokens (nothing
    in float32)."""
    global _inexact_warned
    if lossless_exact(dtype) or _inexact_warned:
        return
    _inexact_warned = True
    logger.warning("lossless decoding in %s: %s", str(dtype).removeprefix("torch."), INEXACT_REASON)
