"""Benchmark methods (the rows of the matrix) and the one function that runs a method on prompts.

A method is full KV, a lossy compressor decoding from its compressed cache, or a lossless method
(speculative decoding that drafts from a compressed cache and verifies with the full one). Full KV and
lossy rows decode with `generate`, lossless rows with `generate_lossless`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from kvlab.compress import Compressor, EvictionCompressor, compressors
from kvlab.engine import generate, generate_lossless
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig, GenerationOutput
from kvlab.generation.outputs import ProgressCallback
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel
from kvlab.store.prefix import PrefixSource

MethodKind = Literal["full", "lossy", "lossless"]
METHOD_KINDS: tuple[str, ...] = ("full", "lossy", "lossless")
FULL_LABEL = "full"


@dataclasses.dataclass(frozen=True, slots=True)
class BenchMethod:
    """One row of the benchmark matrix.

    Attributes:
        label: Name in tables, plots and result folders ("kivi-2", "snapkv-50", ...).
        kind: "full" (plain decoding), "lossy" (decode from the compressed cache) or "lossless"
            (draft from the compressed cache, verify with the full cache).
        compressor: `{"name": key, **params}` of the compressor (lossy: the cache decoded from;
            lossless: the drafter's cache); None for full KV.
        num_draft_tokens: Tokens drafted per verification (lossless only; None adapts the length to
            the measured acceptance).
    """

    label: str
    kind: MethodKind
    compressor: dict[str, Any] | None = None
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.label or "/" in self.label or self.label.startswith("."):
            raise ConfigError(f"method label {self.label!r} must be a non-empty name without '/'")
        if self.kind not in METHOD_KINDS:
            raise ConfigError(f"unknown method kind {self.kind!r}; choose one of: {', '.join(METHOD_KINDS)}")
        if (self.kind == "full") != (self.compressor is None):
            raise ConfigError(f"method {self.label!r}: full KV takes no compressor, {self.kind} methods need one")
        if self.compressor is not None:
            # Validated now, not mid-run; stored with every parameter so results record defaults too.
            object.__setattr__(self, "compressor", compressors.from_dict(self.compressor).to_dict())
        if self.num_draft_tokens is not None:
            if self.kind != "lossless":
                raise ConfigError(f"method {self.label!r}: num_draft_tokens applies to lossless methods only")
            if self.num_draft_tokens < 1:
                raise ConfigError(f"method {self.label!r}: num_draft_tokens must be at least 1 (or None: adaptive)")

    def build_compressor(self) -> Compressor | None:
        return None if self.compressor is None else compressors.from_dict(self.compressor)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> BenchMethod:
        unknown = sorted(set(record) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"benchmark method has unknown key {unknown[0]!r}")
        return cls(**record)


def full_kv() -> BenchMethod:
    return BenchMethod(FULL_LABEL, "full")


def lossy(label: str, name: str, **params: Any) -> BenchMethod:
    return BenchMethod(label, "lossy", {"name": name, **params})


def lossless(label: str, name: str, **params: Any) -> BenchMethod:
    return BenchMethod(label, "lossless", {"name": name, **params})


# Rows with a short name, usable as `--methods kivi-2 snapkv-50`; the benchmark paper's settings.
CATALOG: dict[str, BenchMethod] = {
    method.label: method
    for method in (
        full_kv(),
        lossy("kivi-2", "kivi", bits=2),
        lossy("kivi-4", "kivi", bits=4),
        lossy("turboquant-3", "turboquant", bits=3),
        lossy("turboquant-4", "turboquant", bits=4),
        lossy("snapkv-50", "snapkv", compression_ratio=0.5),
        lossy("snapkv-75", "snapkv", compression_ratio=0.75),
        lossy("cam-50", "cam", compression_ratio=0.5),
        lossy("cam-75", "cam", compression_ratio=0.75),
        lossy("snapkv_agnostic-75", "snapkv_agnostic", compression_ratio=0.75),
        lossy("streamingllm-75", "streamingllm", compression_ratio=0.75),
        lossy("h2o-75", "h2o", compression_ratio=0.75),
        lossless("lossless-kivi-2", "kivi", bits=2),
        lossless("lossless-turboquant-3", "turboquant", bits=3),
        lossless("lossless-snapkv-75", "snapkv", compression_ratio=0.75),
        lossless("lossless-snapkv_agnostic-75", "snapkv_agnostic", compression_ratio=0.75),
        lossless("lossless-streamingllm-75", "streamingllm", compression_ratio=0.75),
    )
}


def parse_method(text: str) -> BenchMethod:
    """A catalog label ("kivi-2"), or `COMPRESSOR:key=value,...` for any compressor setting.

    `lossless:COMPRESSOR:key=value,...[,num_draft_tokens=N]` names a lossless method (adaptive draft
    length unless N is given).
    """
    if text in CATALOG:
        return CATALOG[text]
    kind: MethodKind = "lossy"
    body = text
    if text.startswith("lossless:"):
        kind, body = "lossless", text.removeprefix("lossless:")
    name, _, assignments = body.partition(":")
    if name not in compressors:
        allowed = ", ".join([*CATALOG, "COMPRESSOR:key=value,..."])
        raise ConfigError(f"unknown method {text!r}; choose one of: {allowed} (compressors: {', '.join(compressors)})")
    pairs = [item for item in assignments.split(",") if item]
    draft = [item for item in pairs if item.startswith("num_draft_tokens=")]
    compressor = compressors.create_from_strings(name, [item for item in pairs if item not in draft])
    try:
        num_draft_tokens = int(draft[0].partition("=")[2]) if draft else None
    except ValueError:
        raise ConfigError(f"num_draft_tokens must be an integer in {text!r}") from None
    label = text.replace(":", "-").replace(",", "-").replace("=", "")
    return BenchMethod(label, kind, compressor.to_dict(), num_draft_tokens)


def ratio_label(name: str, ratio: float) -> str:
    """A row label for an eviction/merging compressor at `ratio` ("snapkv", 0.875 -> "snapkv-87.5")."""
    return f"{name}-{100 * ratio:g}"


def uses_compression_ratio(method: BenchMethod) -> bool:
    """A lossy eviction or merging row, whose `compression_ratio` a ratio sweep varies."""
    compressor = method.build_compressor()
    return method.kind == "lossy" and isinstance(compressor, EvictionCompressor)


def expand_ratios(methods: tuple[BenchMethod, ...], ratios: tuple[float, ...]) -> tuple[BenchMethod, ...]:
    """Every lossy eviction/merging row once per ratio (`compression_ratio`, kvpress's meaning); other rows as given.

    Rows of one compressor are collapsed before expanding ("snapkv-50" and "snapkv-75" give the
    sweep once), so a preset's two-budget rows turn into a curve. Order: first occurrence.
    """
    for ratio in ratios:
        if not 0 < ratio < 1:
            raise ConfigError(f"ratios are fractions of prompt tokens removed, in (0, 1); got {ratio}")
    if not ratios:
        return methods
    expanded: dict[str, BenchMethod] = {}
    for method in methods:
        if not uses_compression_ratio(method):
            expanded.setdefault(method.label, method)
            continue
        assert method.compressor is not None
        base = {key: value for key, value in method.compressor.items() if key not in ("compression_ratio", "budget")}
        for ratio in ratios:
            label = ratio_label(base["name"], ratio)
            expanded.setdefault(label, BenchMethod(label, "lossy", {**base, "compression_ratio": ratio}))
    return tuple(expanded.values())


def _run_plain(
    loaded: LoadedModel,
    compressor: Compressor | None,
    prompts: list[list[int]],
    config: GenerationConfig,
    on_progress: ProgressCallback | None,
    prefix: PrefixSource | None,
) -> GenerationOutput:
    return generate(loaded, prompts, config, on_progress=on_progress, compressor=compressor, prefix=prefix)


def _run_lossless(
    loaded: LoadedModel,
    drafter: Compressor | None,
    prompts: list[list[int]],
    config: GenerationConfig,
    on_progress: ProgressCallback | None,
    prefix: PrefixSource | None,
    num_draft_tokens: int | None = None,
) -> GenerationOutput:
    """Lossless speculative decoding (VeriCache): draft from the compressed cache, verify with the full one."""
    assert drafter is not None  # BenchMethod guarantees a compressor for lossless methods
    lossless_config = LosslessConfig(drafter=drafter, num_draft_tokens=num_draft_tokens or "auto")
    return generate_lossless(loaded, prompts, config, lossless_config, on_progress=on_progress, prefix=prefix)


def run_method(
    loaded: LoadedModel,
    method: BenchMethod,
    prompts: list[list[int]],
    config: GenerationConfig,
    on_progress: ProgressCallback | None = None,
    compressor: Compressor | None = None,
    prefix: PrefixSource | None = None,
) -> GenerationOutput:
    """Generate from `prompts` with `method`; texts, token ids and stats as plain generation returns them.

    Args:
        compressor: The compressor to use instead of the one `method` builds (a task may adapt it,
            e.g. compress only what an earlier turn compressed); ignored for full KV.
        prefix: Restore and save prompt prefixes in this store (shared-context tasks).
    """
    chosen = None if method.kind == "full" else compressor or method.build_compressor()
    if method.kind == "lossless":
        return _run_lossless(loaded, chosen, prompts, config, on_progress, prefix, method.num_draft_tokens)
    return _run_plain(loaded, chosen, prompts, config, on_progress, prefix)
