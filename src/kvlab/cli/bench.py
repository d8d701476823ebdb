"""`kvlab bench`: run (or resume) a benchmark matrix and write its report; `kvlab bench report DIR` re-renders."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvlab.bench import BenchCallbacks, preset_config, run_benchmark
from kvlab.bench.config import BenchConfig
from kvlab.bench.methods import parse_method
from kvlab.bench.presets import DEFAULT_PRESET, PRESETS
from kvlab.bench.report import render_report
from kvlab.bench.tasks import tasks
from kvlab.cli.base import EXIT_OK, Command, add_json_flag, print_json
from kvlab.cli.flags import add_config_flags, given_values
from kvlab.errors import ConfigError
from kvlab.registry import parse_value
from kvlab.timing import Stopwatch

RUN_FIELDS = ("dtype", "device", "repeats", "threads", "likelihood")


class BenchCommand(Command):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "action", nargs="?", choices=("run", "report"), default="run", help="run (default) or report"
        )
        parser.add_argument("directory", nargs="?", type=Path, help="results folder (for `report`)")
        parser.add_argument(
            "--preset",
            choices=sorted(PRESETS),
            help=f"the matrix to start from (default: {DEFAULT_PRESET}, CI-sized: ~200-token contexts, 1 sample)",
        )
        parser.add_argument(
            "--methods", nargs="+", metavar="METHOD", help="rows: kivi-2, snapkv-50, ... or COMPRESSOR:key=value,..."
        )
        parser.add_argument(
            "--tasks", nargs="+", metavar="TASK", help="tasks (the preset's settings, or TASK:key=value,...)"
        )
        parser.add_argument("--samples", type=int, help="samples per task (default: the preset's)")
        parser.add_argument(
            "--ratios",
            type=_ratios,
            metavar="R1,R2,...",
            help="run every eviction/merging method at each compression_ratio (fraction of tokens removed), "
            "e.g. 0.25,0.5,0.75,0.875 (default: the preset's)",
        )
        parser.add_argument("--out", type=Path, help="results folder (default: bench-results/PRESET)")
        parser.add_argument("--model", action="append", help="model to benchmark (repeatable; default: the preset's)")
        add_config_flags(parser, BenchConfig, RUN_FIELDS)
        add_json_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        if args.action == "report":
            return self._report(args)
        if args.directory is not None:
            raise ConfigError("a results folder is given with --out; `kvlab bench report DIR` re-renders one")
        preset_name = args.preset or DEFAULT_PRESET
        out = args.out or Path("bench-results") / preset_name
        fields: dict[str, Any] = {"out": str(out), **given_values(args, BenchConfig, RUN_FIELDS)}
        if args.samples is not None:
            fields["samples"] = args.samples
        if args.ratios is not None:
            fields["ratios"] = args.ratios
        if args.model:
            fields["models"] = tuple(args.model)
        if args.tasks:
            fields["tasks"] = tuple(_task_spec(text, PRESETS[preset_name].tasks) for text in args.tasks)
        methods = tuple(parse_method(text) for text in args.methods) if args.methods else None
        config = preset_config(preset_name, methods=methods, **fields)
        with BarCallbacks(enabled=not args.json, defaulted=args.preset is None) as callbacks:
            cells = run_benchmark(config, callbacks)
        report = render_report(Path(config.out))
        if args.json:
            print_json({"out": config.out, "report": str(report), "cells": cells})
        else:
            print(f"{len(cells)} cells in {config.out}; report: {report}")
        return EXIT_OK

    def _report(self, args: argparse.Namespace) -> int:
        if args.directory is None:
            raise ConfigError("`kvlab bench report` needs the results folder: kvlab bench report DIR")
        report = render_report(args.directory)
        if args.json:
            print_json({"report": str(report)})
        else:
            print(f"report: {report}")
        return EXIT_OK


def settings_summary(config: BenchConfig, defaulted: bool) -> str:
    """What the run will measure, in a few lines (the report header repeats it)."""
    note = " (the default: no --preset given)" if defaulted else ""
    tasks_text = ", ".join(
        f"{spec['name']} ({spec.get('context_tokens', 'its own')} ctx, {spec.get('max_new_tokens', 'default')} new)"
        for spec in config.tasks
    )
    return "\n".join([
        f"preset: {config.preset}{note}",
        f"models: {', '.join(config.models)}; samples per task: {config.samples}",
        f"tasks (context tokens, new tokens): {tasks_text}",
        f"methods: {', '.join(method.label for method in config.methods)}",
        *(["likelihood: KL(full || compressed) and perplexities of the full-KV output"] if config.likelihood else []),
    ])


def _ratios(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions like 0.25,0.5, got {text!r}") from None


def _task_spec(text: str, preset_tasks: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """`NAME` (the preset's settings for it, else defaults) or `NAME:key=value,...` on top of those."""
    name, _, assignments = text.partition(":")
    tasks.get(name)  # unknown names fail here, listing the known ones
    spec = next((dict(s) for s in preset_tasks if s["name"] == name), {"name": name})
    hints = {p.name: p for p in tasks.parameters(name)}
    for assignment in filter(None, assignments.split(",")):
        key, sep, raw = assignment.partition("=")
        if not sep or key not in hints:
            raise ConfigError(f"task {name!r}: expected key=value with key in {', '.join(hints)}, got {assignment!r}")
        spec[key] = parse_value(raw, _field_type(name, key))
    return spec


def _field_type(name: str, key: str) -> Any:
    return typing.get_type_hints(tasks.get(name)).get(key, Any)


def progress_line(model: str, task: str, method: str, done: int, total: int, elapsed_s: float) -> str:
    """One line of progress for logs, where no bar is drawn: samples done, time spent and left, the next cell."""
    left = f"about {_duration(elapsed_s / done * (total - done))} left" if done else "time left unknown yet"
    return f"{model}: {done}/{total} samples, {_duration(elapsed_s)} elapsed, {left}; next: {task} / {method}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class BarCallbacks(BenchCallbacks):
    """The run's settings, then progress on stderr: a live bar (samples/s, ETA, the current cell) on a
    terminal, or, when stderr is a log, one line per cell with the samples done and the time left."""

    def __init__(self, enabled: bool, defaulted: bool = False) -> None:
        self.verbose = enabled
        self.enabled = enabled and sys.stderr.isatty()
        self.defaulted = defaulted
        self._bar: tqdm[Any] | None = None
        self._total = self._done = 0
        self._clock = Stopwatch()

    def on_begin(self, config: BenchConfig) -> None:
        if self.verbose:
            print(settings_summary(config, self.defaulted), file=sys.stderr)

    def on_start(self, model: str, total_samples: int) -> None:
        self.close()
        self._total, self._done = total_samples, 0
        self._clock.restart()
        self._bar = tqdm(
            total=total_samples, unit="sample", file=sys.stderr, disable=not self.enabled, dynamic_ncols=True,
            desc=model,
        )

    def on_cell(self, model: str, task: str, method: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{task} / {method}")
        if self.verbose and not self.enabled and self._done < self._total:
            elapsed = self._clock.elapsed()
            print(progress_line(model, task, method, self._done, self._total, elapsed), file=sys.stderr, flush=True)

    def on_sample(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> BarCallbacks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
