"""Plain (full-KV) generation: configuration, sampling, stopping and the decode loop."""

from kvlab.generation.config import GenerationConfig
from kvlab.generation.loop import decode, generate
from kvlab.generation.outputs import GenerationOutput, GenerationStats, RequestOutput
from kvlab.generation.sampling import select_next_tokens, token_probabilities

__all__ = [
    "GenerationConfig",
    "GenerationOutput",
    "GenerationStats",
    "RequestOutput",
    "decode",
    "generate",
    "select_next_tokens",
    "token_probabilities",
]
