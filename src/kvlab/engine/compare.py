"""Full-KV vs lossy vs lossless decoding of the same prompts, side by side."""

from __future__ import annotations

import dataclasses

from kvlab.compress import Compressor
from kvlab.engine.generate import generate, generate_lossless
from kvlab.generation import GenerationConfig, GenerationOutput
from kvlab.generation.outputs import ProgressCallback
from kvlab.lossless.config import LosslessConfig
from kvlab.models import LoadedModel


@dataclasses.dataclass(slots=True)
class ModeResult:
    """One decoding mode's output and how it relates to full-KV decoding.

    Attributes:
        mode: "full", "lossy" or "lossless".
        output: What `generate` / `generate_lossless` returned for the prompts.
        identical_to_full: Every prompt's generated token ids equal the full-KV ones.
        first_divergence: Index of the first generated token that differs from full KV in any prompt,
            or None.
        speedup: This mode's decode tokens/s over full KV's.
        tier_bytes_per_token: Bytes of full KV read from its tier per generated token.
    """

    mode: str
    output: GenerationOutput
    identical_to_full: bool
    first_divergence: int | None
    speedup: float
    tier_bytes_per_token: float


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first position where `tokens` and `reference` differ (None when equal)."""
    for index, (token, expected) in enumerate(zip(tokens, reference, strict=False)):
        if token != expected:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def compare_modes(
    loaded: LoadedModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    compressor: Compressor,
    lossless: LosslessConfig,
    on_progress: ProgressCallback | None = None,
) -> list[ModeResult]:
    """Decode `prompts` with the full cache, lossily from `compressor`'s cache, and losslessly with
    `lossless` (the full KV on `config.full_kv_tier` for full and lossless decoding)."""
    full = generate(loaded, prompts, config, on_progress)
    outputs = {
        "full": full,
        "lossy": generate(loaded, prompts, config, on_progress, compressor=compressor),
        "lossless": generate_lossless(loaded, prompts, config, lossless, on_progress),
    }
    results = []
    for mode, output in outputs.items():
        divergences = [
            first_divergence(request.token_ids, reference.token_ids)
            for request, reference in zip(output.requests, full.requests, strict=True)
        ]
        found = [index for index in divergences if index is not None]
        speedup = (
            output.stats.decode_tokens_per_s / full.stats.decode_tokens_per_s if full.stats.decode_tokens_per_s else 0.0
        )
        per_token = output.stats.tier_bytes_read / max(output.stats.new_tokens, 1)
        results.append(ModeResult(mode, output, not found, min(found) if found else None, speedup, per_token))
    return results
