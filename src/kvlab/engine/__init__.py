"""The engine every request runs through: `Request`s in, continuous batching, outputs out.

`Engine` is the public API (`add_request`, `step`, `cancel`, `output`); `generate` and
`generate_lossless` are its offline front doors for a batch of prompts; `teacher_forced_logits` feeds
given tokens through a full and a compressed cache, for scoring. `run_to_end` runs coroutines of feeds
packed, outside an engine (the vLLM proposer's drafts), and `pack`/`run_batch` one packed forward of
`Feed`s.
"""

from kvlab.engine.compare import ModeResult, compare_modes, first_divergence
from kvlab.engine.config import EngineCallbacks, EngineConfig
from kvlab.engine.engine import EXACT, Engine
from kvlab.engine.generate import generate, generate_lossless, run_requests
from kvlab.engine.prefixes import PrefixFetcher, PrefixSources, SinglePrefixSource
from kvlab.engine.request import Mode, PrefilledPrompt, Request
from kvlab.engine.runner import PackedBatch, pack, run_batch, run_to_end
from kvlab.engine.teacher import TeacherForcing, continuation_pieces, teacher_forced_logits
from kvlab.generation.feed import Feed

__all__ = [
    "EXACT",
    "Engine",
    "EngineCallbacks",
    "EngineConfig",
    "Feed",
    "Mode",
    "ModeResult",
    "PackedBatch",
    "PrefilledPrompt",
    "PrefixFetcher",
    "PrefixSources",
    "Request",
    "SinglePrefixSource",
    "TeacherForcing",
    "compare_modes",
    "continuation_pieces",
    "first_divergence",
    "generate",
    "generate_lossless",
    "pack",
    "run_batch",
    "run_requests",
    "run_to_end",
    "teacher_forced_logits",
]
