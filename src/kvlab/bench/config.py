"""What a benchmark run measures: models x tasks x methods, sample count, repeats, output folder."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.bench.methods import FULL_LABEL, BenchMethod, expand_ratios, full_kv
from kvlab.bench.tasks import tasks
from kvlab.errors import ConfigError
from kvlab.models import DEFAULT_MODEL, DTYPES


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """A benchmark matrix and how to run it.

    Full KV is always a row: it is added first when missing (fidelity compares every method with it).

    Attributes:
        tasks: Task specs `{"name": key, **params}` (see `kvlab ls`), each task at most once.
        methods: Method rows (see `kvlab.bench.methods`).
        samples: Samples per task (fewer when the data has fewer well-formed rows).
        out: Result folder; finished cells found there are skipped.
        models: Models to benchmark (embedded alias, GGUF file, model dir or cached hub id).
        warmup: Run each method once on a short prompt before measuring it.
        dtype, device, repeats, threads, likelihood: see each field's help (`kvlab bench` shows the
            same text).
        ratios: Run every lossy eviction/merging row at each of these `compression_ratio`s (fractions
            of prompt tokens removed) instead of its own; empty keeps the rows as given.
        preset: Name of the preset the matrix came from ("custom" when built by hand); shown in reports.
    """

    tasks: tuple[dict[str, Any], ...]
    methods: tuple[BenchMethod, ...]
    samples: int = 8
    out: str = "bench-results"
    models: tuple[str, ...] = (DEFAULT_MODEL,)
    dtype: str = dataclasses.field(default="float32", metadata={"help": "weights and KV dtype"})
    device: str = dataclasses.field(default="cpu", metadata={"help": "torch device (cpu, cuda, cuda:1)"})
    repeats: int = dataclasses.field(
        default=1, metadata={"help": "generations per sample; timings are the median over them (outputs must agree)"}
    )
    warmup: bool = True
    threads: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "torch CPU threads during the run (default: torch's choice); on a shared machine one thread "
            "gives steadier timings than threads that wait for each other"
        },
    )
    likelihood: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "also score every sample's full-KV output under each method's cache: mean KL(full || compressed) "
            "per token and perplexities (one more prefill per sample and method, untimed)"
        },
    )
    ratios: tuple[float, ...] = ()
    preset: str = "custom"

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be at least 1 (or None for torch's default), got {self.threads}")
        if self.samples < 1:
            raise ConfigError(f"samples must be at least 1, got {self.samples}")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be at least 1, got {self.repeats}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose one of: {', '.join(DTYPES)}")
        if not self.tasks:
            raise ConfigError(f"no tasks given; choose from: {', '.join(tasks.names())}")
        if not self.models:
            raise ConfigError("no models given")
        names = [spec.get("name") for spec in self.tasks]
        if len(set(names)) != len(names):
            raise ConfigError(f"each task may appear once, got {names}")
        for spec in self.tasks:
            tasks.from_dict(spec)
        object.__setattr__(self, "ratios", tuple(self.ratios))
        object.__setattr__(self, "methods", expand_ratios(tuple(self.methods), self.ratios))
        labels = [method.label for method in self.methods]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"method labels must be unique, got {labels}")
        if FULL_LABEL not in labels:
            object.__setattr__(self, "methods", (full_kv(), *self.methods))
        else:
            full = self.methods[labels.index(FULL_LABEL)]
            if full.kind != "full":
                raise ConfigError(f"the label {FULL_LABEL!r} is reserved for full KV")
            object.__setattr__(self, "methods", (full, *(m for m in self.methods if m is not full)))

    def to_dict(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["methods"] = [method.to_dict() for method in self.methods]
        return record
