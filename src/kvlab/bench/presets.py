"""Named benchmark matrices: `smoke` (CI-sized, the default), `paper` (the benchmark paper's matrix),
`curves` (quality against the compression ratio) and `multiturn` (one compressed context, many questions)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.bench.config import BenchConfig
from kvlab.bench.methods import BenchMethod, parse_method
from kvlab.errors import ConfigError
from kvlab.models import DEFAULT_MODEL

# The second real model (installed by `make setup`), run beside the embedded one by the research presets.
SECOND_MODEL = "gemma3-270m"


@dataclasses.dataclass(frozen=True, slots=True)
class Preset:
    """Tasks, methods, models and a default sample count; `BenchConfig` fields not named keep their defaults."""

    description: str
    tasks: tuple[dict[str, Any], ...]
    methods: tuple[str, ...]
    samples: int
    models: tuple[str, ...] = (DEFAULT_MODEL,)
    ratios: tuple[float, ...] = ()


SMOKE = Preset(
    description="every shipped task at ~200-token contexts, 1 sample, full KV vs KIVI-2 (a few minutes on 2 cores)",
    tasks=(
        {"name": "hotpotqa", "context_tokens": 192, "max_new_tokens": 8},
        {"name": "squad", "context_tokens": 192, "max_new_tokens": 8},
        {"name": "niah", "context_tokens": 192, "max_new_tokens": 12},
        {"name": "variable_tracking", "context_tokens": 192, "max_new_tokens": 12},
        {"name": "xsum", "context_tokens": 192, "max_new_tokens": 12},
        {"name": "multilexsum", "context_tokens": 192, "max_new_tokens": 12},
        {"name": "imdb_fewshot", "context_tokens": 256, "example_tokens": 48, "max_new_tokens": 2},
        {"name": "humaneval", "max_new_tokens": 24},
        {"name": "bfcl", "max_new_tokens": 16},
        {"name": "math500", "max_new_tokens": 12},
    ),
    methods=("full", "kivi-2"),
    samples=1,
)

# The benchmark paper's methods and workloads (design 2 in PAPERS.md), on 2K-token contexts.
PAPER_METHODS = (
    "full",
    "kivi-2",
    "kivi-4",
    "turboquant-3",
    "turboquant-4",
    "snapkv-50",
    "snapkv-75",
    "cam-50",
    "cam-75",
)
# VeriCache's row: the KIVI-2 cache drafts, the full cache verifies (output equal to full KV).
PAPER_LOSSLESS_METHODS = ("lossless-kivi-2",)

PAPER = Preset(
    description="the benchmark paper's matrix on 2K-token contexts: full KV, KIVI-2/4, TurboQuant-3/4, "
    "SnapKV and CaM at 50% and 75% eviction, lossless KIVI-2 drafting, on multi-doc QA, single-doc QA, "
    "few-shot, summarization",
    tasks=(
        {"name": "hotpotqa", "context_tokens": 2048, "max_new_tokens": 24},
        {"name": "squad", "context_tokens": 2048, "max_new_tokens": 24},
        {"name": "imdb_fewshot", "context_tokens": 2048, "max_new_tokens": 3},
        {"name": "multilexsum", "context_tokens": 2048, "max_new_tokens": 64},
        {"name": "xsum", "context_tokens": 2048, "max_new_tokens": 48},
    ),
    methods=PAPER_METHODS + PAPER_LOSSLESS_METHODS,
    samples=5,
    models=(DEFAULT_MODEL, SECOND_MODEL),
)

# kvpress's leaderboard ratios; quantizers run at their bit widths and land on the same axis by their
# measured KV bytes ratio; lossless rows stay at full quality.
CURVE_RATIOS = (0.25, 0.5, 0.75, 0.875)

CURVES = Preset(
    description="RULER retrieval, variable tracking and QA at 2K tokens: SnapKV, StreamingLLM and CaM at "
    "compression ratios 0.25/0.5/0.75/0.875, KIVI-2/4, TurboQuant-3/4, lossless KIVI-2 drafting",
    tasks=(
        {"name": "niah", "context_tokens": 2048, "max_new_tokens": 24},
        {"name": "variable_tracking", "context_tokens": 2048, "max_new_tokens": 16},
        {"name": "squad", "context_tokens": 2048, "max_new_tokens": 24},
    ),
    methods=(
        "full",
        "snapkv-50",
        "streamingllm-75",
        "cam-50",
        "kivi-2",
        "kivi-4",
        "turboquant-3",
        "turboquant-4",
        "lossless-kivi-2",
    ),
    samples=3,
    models=(DEFAULT_MODEL, SECOND_MODEL),
    ratios=CURVE_RATIOS,
)

# SCBench's question: a cache compressed for the first question, reused for the next ones. Query-aware
# (SnapKV) against query-agnostic compression (StreamingLLM, KIVI, TurboQuant, SnapKV with a generic
# window), each also as the drafter of lossless decoding.
MULTITURN = Preset(
    description="4 questions in turn about each of 3 SQuAD articles (2K tokens), the context compressed once at "
    "the first question and reused through a prefix store: SnapKV vs query-agnostic compressors, lossy and as drafters",
    tasks=({"name": "multiturn_squad", "context_tokens": 2048, "num_turns": 4, "max_new_tokens": 16},),
    methods=(
        "full",
        "snapkv-75",
        "snapkv_agnostic-75",
        "streamingllm-75",
        "kivi-2",
        "turboquant-3",
        "lossless-snapkv-75",
        "lossless-snapkv_agnostic-75",
        "lossless-streamingllm-75",
        "lossless-kivi-2",
        "lossless-turboquant-3",
    ),
    samples=12,
    models=(DEFAULT_MODEL, SECOND_MODEL),
)

# `kvlab bench` without --preset runs this one (and says so in its output and report).
DEFAULT_PRESET = "smoke"

PRESETS: dict[str, Preset] = {"smoke": SMOKE, "paper": PAPER, "curves": CURVES, "multiturn": MULTITURN}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def preset_config(name: str, methods: tuple[BenchMethod, ...] | None = None, **fields: Any) -> BenchConfig:
    """The preset's `BenchConfig`, with any field (samples, out, methods, models, ratios, ...) overridden."""
    chosen = preset(name)
    default_methods = tuple(parse_method(label) for label in chosen.methods)
    fields.setdefault("tasks", chosen.tasks)
    fields.setdefault("samples", chosen.samples)
    fields.setdefault("models", chosen.models)
    fields.setdefault("ratios", chosen.ratios)
    return BenchConfig(methods=methods or default_methods, preset=name, **fields)
