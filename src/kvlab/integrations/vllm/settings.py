"""`KVLabDraftProposer`'s settings: vLLM passes a `custom_class` proposer nothing but its own config, so they
come from the environment (docs/vllm.md lists them)."""

from __future__ import annotations

import json
import os
from typing import Any

from kvlab.compress import Compressor, compressors
from kvlab.errors import ConfigError
from kvlab.lossless.prompt_lookup import PromptLookup, split_drafter_name
from kvlab.models.draft_weights import DRAFT_WEIGHTS, DraftWeights

DRAFTER_ENV = "KVLAB_VLLM_DRAFTER"
DRAFT_WEIGHTS_ENV = "KVLAB_VLLM_DRAFT_WEIGHTS"
DRAFT_LENGTH_ENV = "KVLAB_VLLM_DRAFT_LENGTH"
DRAFT_LENGTHS = ("auto", "fixed")
DEFAULT_DRAFTER: dict[str, Any] = {"name": "snapkv"}


def drafter_from_environment() -> tuple[Compressor, PromptLookup | None]:
    """The compressor `KVLAB_VLLM_DRAFTER` names (JSON), or SnapKV with its defaults, and the prompt
    lookup its name composes it with (`ngram+snapkv`), if any."""
    text = os.environ.get(DRAFTER_ENV)
    try:
        spec = json.loads(text) if text else dict(DEFAULT_DRAFTER)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{DRAFTER_ENV} must be JSON like {{\"name\": \"snapkv\"}}, got {text!r}: {error}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{DRAFTER_ENV} must be a JSON object with a 'name', got {text!r}")
    lookup, name = split_drafter_name(str(spec.get("name", "")))
    return compressors.from_dict({**spec, "name": name}), lookup


def draft_length_from_environment() -> str:
    """`KVLAB_VLLM_DRAFT_LENGTH`: `auto` (default: kvlab's planner chooses each row's source and length, or
    nothing) or `fixed` (every row proposes `num_speculative_tokens`: its lookup's continuation where it
    has one, else the compressed cache's)."""
    length = os.environ.get(DRAFT_LENGTH_ENV) or "auto"
    if length not in DRAFT_LENGTHS:
        raise ConfigError(f"{DRAFT_LENGTH_ENV} must be one of {', '.join(DRAFT_LENGTHS)}, got {length!r}")
    return length


def draft_weights_from_environment() -> DraftWeights:
    """The draft weights `KVLAB_VLLM_DRAFT_WEIGHTS` names (`same` when unset)."""
    weights = os.environ.get(DRAFT_WEIGHTS_ENV) or "same"
    if weights not in DRAFT_WEIGHTS:
        raise ConfigError(f"{DRAFT_WEIGHTS_ENV} must be one of {', '.join(DRAFT_WEIGHTS)}, got {weights!r}")
    return weights  # type: ignore[return-value]
