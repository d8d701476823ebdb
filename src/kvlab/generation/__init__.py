"""Plain decoding's pieces: configuration, sampling, stopping, prefill, outputs, feeds, and the plain
reference decoder that equality tests compare against (`reference_generate`). Decoding itself runs
through `kvlab.engine` (`kvlab.engine.generate`)."""

from kvlab.generation.config import GenerationConfig
from kvlab.generation.outputs import GenerationOutput, GenerationStats, RequestOutput
from kvlab.generation.reference import reference_decode, reference_generate
from kvlab.generation.sampling import select_next_tokens, token_probabilities

__all__ = [
    "GenerationConfig",
    "GenerationOutput",
    "GenerationStats",
    "RequestOutput",
    "reference_decode",
    "reference_generate",
    "select_next_tokens",
    "token_probabilities",
]
