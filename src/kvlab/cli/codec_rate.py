"""`kvlab codec bench --rate-fidelity`: rate against fidelity of every code-lossless coder, table and plot."""

from __future__ import annotations

import argparse
import dataclasses

from kvlab.bench.codec import collect_kv
from kvlab.bench.codec.fidelity import PAPER_BITS_PER_VALUE, RATE_BITS, rate_cases, rate_fidelity
from kvlab.bench.codec.plot import save_rate_fidelity_plot
from kvlab.bench.codec.report import rate_fidelity_tables
from kvlab.cli.base import EXIT_OK, print_json
from kvlab.cli.progress import TokenProgress
from kvlab.errors import ConfigError
from kvlab.models import load_model


def parse_bits(text: str) -> list[int]:
    """`"8,4,2"` -> `[8, 4, 2]`, each one of RATE_BITS."""
    try:
        bits = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--bits must be comma-separated integers, got {text!r}") from None
    if not bits or any(b not in RATE_BITS for b in bits):
        raise ConfigError(f"--bits must list values from {list(RATE_BITS)}, got {text!r}")
    return bits


def rate_fidelity_command(args: argparse.Namespace) -> int:
    bits = parse_bits(args.bits)
    if args.samples_per_task < 0:
        raise ConfigError(f"--samples-per-task must be at least 0, got {args.samples_per_task}")
    if not args.plot.parent.is_dir():
        raise ConfigError(f"cannot write {args.plot}: directory {args.plot.parent} does not exist")
    loaded = load_model(args.model)
    if args.context > loaded.architecture.max_context:
        raise ConfigError(
            f"--context {args.context} exceeds {loaded.name}'s context of {loaded.architecture.max_context} tokens"
        )
    keys, values = collect_kv(loaded, args.context)
    steps = len(rate_cases(bits)) + 3 * args.samples_per_task
    with TokenProgress(total=steps, enabled=not args.json, unit="step") as progress:
        report = rate_fidelity(loaded, keys, values, samples_per_task=args.samples_per_task, bits_list=bits,
                               on_progress=lambda _: progress.update(1))
    title = f"{loaded.name}: KV of {args.context} tokens, {list(keys.shape)} keys and values"
    plot = save_rate_fidelity_plot(report, args.plot, title)
    if args.json:
        print_json({"model": loaded.name, "context": args.context, "kv_shape": list(keys.shape),
                    "paper_bits_per_value": PAPER_BITS_PER_VALUE, "plot": str(plot),
                    "results": [dataclasses.asdict(row) for row in report.rates],
                    "bounds": [dataclasses.asdict(bound) for bound in report.bounds],
                    "fidelity": [dataclasses.asdict(row) for row in report.fidelity], "tasks": report.tasks})
        return EXIT_OK
    print(f"{title}, fp16, {2 * 2 * keys.numel() / 1e6:.1f} MB")
    print(rate_fidelity_tables(report))
    print(f"\nplot: {plot}")
    return EXIT_OK
