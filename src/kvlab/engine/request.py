"""What a caller asks the engine to decode: a prompt, its decoding settings and its mode."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from kvlab.cache import KVCache
from kvlab.compress import Compressor
from kvlab.errors import ConfigError
from kvlab.generation.config import GenerationConfig
from kvlab.lossless.config import LosslessConfig

Mode = Literal["plain", "lossy", "lossless"]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One prompt to decode.

    The mode follows from what is given: neither `compressor` nor `lossless` decodes plainly from the
    full cache; `compressor` decodes lossily from the cache it compresses; `lossless` drafts from its
    drafter's compressed cache and verifies with the full one (the plain output, token for token when
    greedy in float32; see `LosslessConfig`).

    Attributes:
        prompt: Token ids the model is fed.
        config: Sampling, stop rules, length limit, full-KV tier, prefill chunking.
        compressor: Lossy decoding's compressor.
        lossless: Lossless decoding's drafter and draft settings (each honoured for this request alone).
        cache_salt: Prefix-store namespace: only requests with the same salt share stored prefixes.
    """

    prompt: list[int]
    config: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    compressor: Compressor | None = None
    lossless: LosslessConfig | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.compressor is not None and self.lossless is not None:
            raise ConfigError("a request decodes lossily (compressor) or losslessly (lossless), not both")

    @property
    def mode(self) -> Mode:
        if self.lossless is not None:
            return "lossless"
        return "plain" if self.compressor is None else "lossy"

    @property
    def num_tokens(self) -> int:
        """Prompt and new tokens: what the request may hold in its cache, a round's drafts aside."""
        return len(self.prompt) + self.config.max_new_tokens

    @property
    def drafter_name(self) -> str | None:
        """The registry name of the compressor whose cache decodes (lossy) or drafts (lossless, `ngram+` first
        with prompt lookup)."""
        if self.lossless is not None:
            return self.lossless.drafter_name
        return None if self.compressor is None else str(type(self.compressor).registry_name)  # type: ignore[attr-defined]

    @property
    def reuses_prefixes(self) -> bool:
        """Its prefill may restore the prompt from a prefix store: not when it asks for the prompt's
        log-probabilities, which need every position computed."""
        return self.config.prompt_logprobs is None

    @property
    def capacity(self) -> int:
        """Tokens the request's caches must hold: prompt, new tokens and, lossless, one round's drafts."""
        drafts = 0 if self.lossless is None else self.lossless.max_num_draft_tokens + 2
        return len(self.prompt) + self.config.max_new_tokens + drafts


@dataclasses.dataclass(slots=True)
class PrefilledPrompt:
    """A prompt already prefilled elsewhere (e.g. once for several runs); the engine consumes the caches.

    Attributes:
        cache: [1 row] the prompt's KV: full, or compressed for lossy decoding.
        draft: [1 row] the drafter's compressed copy (lossless requests), else None.
        logits: [1, V] logits of the prompt's last position.
        reused_tokens: Prompt tokens that came from a prefix store.
    """

    cache: KVCache
    draft: KVCache | None
    logits: torch.Tensor
    reused_tokens: int = 0
