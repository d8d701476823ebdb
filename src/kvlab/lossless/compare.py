"""Full-KV vs lossy vs lossless decoding of the same prompt, side by side."""

from __future__ import annotations

import dataclasses

from kvlab.compress import Compressor
from kvlab.generation import GenerationConfig, GenerationOutput, generate
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.engine import generate_lossless
from kvlab.models import LoadedModel


@dataclasses.dataclass(slots=True)
class ModeResult:
    """One decoding mode's output and how it relates to full-KV decoding.

    Attributes:
        mode: "full", "lossy" or "lossless".
        output: What `generate` / `generate_lossless` returned for the single prompt.
        identical_to_full: The generated token ids equal the full-KV ones.
        first_divergence: Index of the first generated token that differs from full KV, or None.
        speedup: Full-KV decode time divided by this mode's (tokens after the first).
    """

    mode: str
    output: GenerationOutput
    identical_to_full: bool
    first_divergence: int | None
    speedup: float


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """Index of the first position where `tokens` and `reference` differ (None when equal)."""
    for index, (token, expected) in enumerate(zip(tokens, reference)):
        if token != expected:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def compare_modes(
    loaded: LoadedModel, prompt: list[int], config: GenerationConfig, compressor: Compressor, lossless: LosslessConfig
) -> list[ModeResult]:
    """Decode `prompt` with the full cache, lossily from `compressor`'s cache, and losslessly with `lossless`."""
    full = generate(loaded, [prompt], config)
    outputs = {
        "full": full,
        "lossy": generate(loaded, [prompt], config, compressor=compressor),
        "lossless": generate_lossless(loaded, [prompt], config, lossless),
    }
    reference = full.requests[0].token_ids
    results = []
    for mode, output in outputs.items():
        divergence = first_divergence(output.requests[0].token_ids, reference)
        speedup = full.stats.decode_s / output.stats.decode_s if output.stats.decode_s > 0 else 0.0
        results.append(ModeResult(mode, output, divergence is None, divergence, speedup))
    return results
