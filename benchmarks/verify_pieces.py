"""A verify forward with and without the key pieces (`kvlab.attention_kernels.verify_in_pieces`), interleaved.

Usage: .venv/bin/python benchmarks/verify_pieces.py [--contexts 4096 8064] [--verify-tokens 1 4 8 16]
           [--repeats 7] [--json PATH]

The embedded SmolLM2 prefills the bundled document once per context; each verify of 1 + k tokens is then
timed as the engine runs it (`benchmarks/roofline.py`'s `Forward`: one packed segment, its cache rolled
back after), once with the pieces and once with the scores written out as matrix products (the pieces'
threshold raised past every cache), alternating within each repeat so drift on a shared machine hits both
alike. Prints the median of each and their ratio.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8064])
    parser.add_argument("--verify-tokens", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args()

    loaded = load_model()
    warm_up_decode_attention(loaded)
    longest = max(args.contexts) + max(args.verify_tokens) + 2
    document = document_token_ids(loaded.tokenizer, longest)
    forwards = []
    for context in args.contexts:
        cache, _, _ = prefill(loaded, [document[:context]], PrefillCaches(longest))
        for k in args.verify_tokens:
            forwards.append(Forward(f"verify 1 + {k}", loaded.model, [cache], k + 1, document[context:], context))
    threshold = attention_kernels.PIECES_MIN_KEYS
    samples: dict[tuple[str, bool], list[float]] = {}
    for repeat in range(args.repeats + 1):  # the first round warms every shape up and is not kept
        for pieces in (False, True):
            attention_kernels.PIECES_MIN_KEYS = threshold if pieces else sys.maxsize
            for forward in forwards:
                seconds = forward.run()
                if repeat:
                    samples.setdefault((f"{forward.name}, {forward.context}", pieces), []).append(seconds)
    attention_kernels.PIECES_MIN_KEYS = threshold

    rows = []
    print(f"embedded SmolLM2-135M, fp32, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| forward | context | written out ms | pieces ms | pieces / written out |")
    print("|---|---|---|---|---|")
    for forward in forwards:
        key = f"{forward.name}, {forward.context}"
        before = statistics.median(samples[(key, False)]) * 1e3
        after = statistics.median(samples[(key, True)]) * 1e3
        rows.append({"forward": forward.name, "context": forward.context, "written_out_ms": before,
                     "pieces_ms": after, "ratio": after / before})
        print(f"| {forward.name} | {forward.context} | {before:.1f} | {after:.1f} | {after / before:.2f}x |")
    if args.json:
        header = {"threads": torch.get_num_threads(), "repeats": args.repeats,
                  "pieces_min_keys": threshold, "pieces_min_queries": attention_kernels.PIECES_MIN_QUERIES}
        args.json.write_text(json.dumps({"run": header, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
