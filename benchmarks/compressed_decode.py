"""Decode cost and realized size of every compressor vs the full cache, measured in one run.

Usage: .venv/bin/python benchmarks/compressed_decode.py [--context 8064] [--new-tokens 24] [--repeats 2]

Each method prefills the same bundled document (compressing it), then decodes greedily; the table
gives decode ms/token, that time divided by the full cache's, the realized `kv_bytes_ratio` (fp16
full bytes / stored bytes, everything stored counted) and whether the output still equals the
full-cache output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from kvlab.compress import Compressor, create_compressor
from kvlab.data import document_token_ids
from kvlab.engine import generate
from kvlab.generation import GenerationConfig
from kvlab.models import LoadedModel, load_model

METHODS: list[tuple[str, str | None, dict[str, object]]] = [
    ("full", None, {}),
    ("snapkv-90", "snapkv", {"compression_ratio": 0.9}),
    ("h2o-90", "h2o", {"compression_ratio": 0.9}),
    ("streamingllm-90", "streamingllm", {"compression_ratio": 0.9}),
    ("cam-90", "cam", {"compression_ratio": 0.9}),
    ("kivi-4", "kivi", {"bits": 4}),
    ("kivi-2", "kivi", {"bits": 2}),
    ("turboquant-4", "turboquant", {"bits": 4}),
    ("turboquant-3", "turboquant", {"bits": 3}),
]


def measure(
    loaded: LoadedModel, prompt: list[int], compressor: Compressor | None, new_tokens: int
) -> dict[str, object]:
    output = generate(
        loaded, [prompt], GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True), compressor=compressor
    )
    stats = output.stats
    return {
        "ttft_s": stats.ttft_s,
        "decode_ms": 1000 * stats.decode_s / (new_tokens - 1),
        "kv_bytes_ratio": stats.kv_bytes_ratio,
        "kv_mib": stats.kv_bytes / 2**20,
        "tokens": output.requests[0].token_ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8064)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    loaded = load_model()
    prompt = document_token_ids(loaded.tokenizer, args.context)
    measure(loaded, prompt[:256], None, 4)
    rows = []
    for label, name, params in METHODS:
        if args.methods and label not in args.methods and label != "full":
            continue
        compressor = create_compressor(name, **params) if name else None
        runs = [measure(loaded, prompt, compressor, args.new_tokens) for _ in range(args.repeats)]
        rows.append(
            {
                "method": label,
                "ttft_s": statistics.median(float(run["ttft_s"]) for run in runs),  # type: ignore[arg-type]
                "decode_ms": statistics.median(float(run["decode_ms"]) for run in runs),  # type: ignore[arg-type]
                "kv_bytes_ratio": runs[0]["kv_bytes_ratio"],
                "kv_mib": runs[0]["kv_mib"],
                "tokens": runs[0]["tokens"],
            }
        )
    full_decode_ms, full_tokens = rows[0]["decode_ms"], rows[0]["tokens"]
    for row in rows:
        row["decode_vs_full"] = row["decode_ms"] / full_decode_ms
        row["same_output_as_full"] = row.pop("tokens") == full_tokens
    if args.json:
        print(json.dumps({"context": args.context, "threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return
    print(
        f"embedded SmolLM2-135M, fp32, {args.context}-token context, {args.new_tokens} new tokens, "
        f"median of {args.repeats}, {torch.get_num_threads()} threads, load avg {os.getloadavg()[0]:.2f}"
    )
    print("| method | kv_bytes_ratio | KV MiB | TTFT s | decode ms/tok | decode vs full | output = full |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['method']} | {row['kv_bytes_ratio']:.2f} | {row['kv_mib']:.1f} | {row['ttft_s']:.1f} | "
            f"{row['decode_ms']:.1f} | {row['decode_vs_full']:.2f} | {'yes' if row['same_output_as_full'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
