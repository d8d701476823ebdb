"""Plain decode steps with the C++ split-KV kernel and with its fallback (the compiled split-KV), interleaved.

Usage: .venv/bin/python benchmarks/decode_attention.py [--contexts 4096 8064] [--batches 1 4 8]
           [--repeats 7] [--json PATH]

The embedded SmolLM2 prefills the bundled document once per context; a plain step of `batch` sequences
at that context (copies of the cache, one packed forward, each cache rolled back after:
`benchmarks/roofline.py`'s `Forward`) is then timed with the C++ kernel
(`kvlab.attention_kernels.NEWEST_ATTENTION`: one call per layer for every sequence) and with it set aside
(the compiled `split_kv_decode`, one call per sequence and layer), alternating within each repeat so
drift on a shared machine hits both alike. Prints the median of each, their ratio, and the rate each
moved the step's bytes (weights once, every sequence's keys and values).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

from kvlab import attention_kernels
from kvlab.data import document_token_ids
from kvlab.generation.prefill import PrefillCaches, prefill
from kvlab.models import load_model

sys.path.insert(0, str(Path(__file__).parent))
from lossless_decode import warm_up_decode_attention
from roofline import Forward

KERNELS = ("compiled split-KV", "C++ kernel")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8064])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args()

    loaded = load_model()
    kernel = attention_kernels.NEWEST_ATTENTION
    if not kernel.ready():
        raise SystemExit("the C++ attention kernel did not build here (it needs g++ and ninja): nothing to compare")
    with kernel.set_aside():
        warm_up_decode_attention(loaded)
    longest = max(args.contexts) + 2
    document = document_token_ids(loaded.tokenizer, longest)
    forwards = []
    for context in args.contexts:
        cache, _, _ = prefill(loaded, [document[:context]], PrefillCaches(longest))
        for batch in args.batches:
            caches = [cache] + [cache.clone() for _ in range(batch - 1)]
            forwards.append(Forward(f"plain step, batch {batch}", loaded.model, caches, 1, document[context:], context))
    samples: dict[tuple[int, str], list[float]] = {}
    for repeat in range(args.repeats + 1):  # the first round warms every shape up and is not kept
        for name in KERNELS if repeat % 2 else reversed(KERNELS):
            with kernel.set_aside() if name == KERNELS[0] else contextlib.nullcontext():
                for index, forward in enumerate(forwards):
                    seconds = forward.run()
                    if repeat:
                        samples.setdefault((index, name), []).append(seconds)

    rows = []
    print(f"embedded SmolLM2-135M, fp32, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| forward | context | MB moved | compiled split-KV ms | C++ kernel ms | C++ / split | split GB/s "
          "| C++ GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for index, forward in enumerate(forwards):
        before, after = (statistics.median(samples[(index, name)]) for name in KERNELS)
        moved = forward.bytes_moved()
        rows.append({"forward": forward.name, "context": forward.context, "batch": len(forward.caches),
                     "mb_moved": moved / 1e6, "split_ms": before * 1e3, "cpp_ms": after * 1e3,
                     "ratio": after / before, "split_gb_s": moved / before / 1e9, "cpp_gb_s": moved / after / 1e9})
        print(f"| {forward.name} | {forward.context} | {moved / 1e6:.0f} | {before * 1e3:.1f} | {after * 1e3:.1f} "
              f"| {after / before:.2f}x | {moved / before / 1e9:.1f} | {moved / after / 1e9:.1f} |")
    if args.json:
        header = {"threads": torch.get_num_threads(), "repeats": args.repeats,
                  "chunk": attention_kernels.NEWEST_ATTENTION_CHUNK}
        args.json.write_text(json.dumps({"run": header, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
