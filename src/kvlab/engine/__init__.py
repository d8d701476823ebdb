"""The engine every request runs through: `Request`s in, continuous batching, outputs out.

`Engine` is the public API (`add_request`, `step`, `cancel`, `output`); `generate` and
`generate_lossless` are its offline front doors for a batch of prompts.
"""

from kvlab.engine.compare import ModeResult, compare_modes, first_divergence
from kvlab.engine.config import EngineCallbacks, EngineConfig
from kvlab.engine.engine import EXACT, Engine
from kvlab.engine.generate import generate, generate_lossless, run_requests
from kvlab.engine.prefixes import PrefixFetcher, PrefixSources, SinglePrefixSource
from kvlab.engine.request import Mode, PrefilledPrompt, Request

__all__ = [
    "EXACT",
    "Engine",
    "EngineCallbacks",
    "EngineConfig",
    "Mode",
    "ModeResult",
    "PrefilledPrompt",
    "PrefixFetcher",
    "PrefixSources",
    "Request",
    "SinglePrefixSource",
    "compare_modes",
    "first_divergence",
    "generate",
    "generate_lossless",
    "run_requests",
]
