"""How often prompt lookup's proposals are right, by the length of the n-gram they matched.

Usage: .venv/bin/python benchmarks/lookup_matches.py [--num-draft-tokens 4] [--max-ngram N] [--json PATH]

Replays kvlab plain's greedy outputs kept by `benchmarks/peers.py` (docs/peers-plain.json: the bundled document
at 4096 tokens; docs/peers-summary-6k.json: the 6452-token summary prompt) as speculative decoding that verifies
a lookup proposal of `--num-draft-tokens` at every step: at each step the lookup (`ngram+` drafters' defaults:
n-grams of 8, or `--max-ngram`, down to 1 token) proposes what followed the longest recent match of the
context's last tokens, the proposal's leading tokens equal to the greedy output are accepted, and the next step
starts after them.
Per matched n-gram length it prints the steps, how often the first draft was right, and the drafts accepted
per step. No model runs: the outputs are the kept ones, so this is exact and takes seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from kvlab.data import document_token_ids
from kvlab.lossless.prompt_lookup import PromptLookup, find_match

ROOT = Path(__file__).resolve().parents[1]


def replay(prompt: list[int], output: list[int], lookup: PromptLookup, num_draft_tokens: int) -> dict[str, Any]:
    """Steps, first drafts right and drafts accepted per matched n-gram length (0: no match) over `output`."""
    by_ngram: dict[int, dict[str, int]] = {}
    done = 1  # the prefill gives the first token
    while done < len(output):
        match = find_match(prompt + output[:done], num_draft_tokens, lookup)
        accepted = 0
        for drafted, right in zip(match.token_ids, output[done:], strict=False):
            if drafted != right:
                break
            accepted += 1
        counts = by_ngram.setdefault(match.ngram, {"steps": 0, "first_right": 0, "accepted": 0})
        counts["steps"] += 1
        counts["first_right"] += accepted > 0
        counts["accepted"] += accepted
        done += accepted + 1
    return {str(ngram): {**counts, "first_right_fraction": counts["first_right"] / counts["steps"],
                         "accepted_per_step": counts["accepted"] / counts["steps"]}
            for ngram, counts in sorted(by_ngram.items())}


def cases() -> dict[str, tuple[list[int], list[int]]]:
    """Each prompt's token ids and kvlab plain's greedy output kept for it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from peers import long_summary_prompt_ids

    from kvlab.integrations.vllm.model import model_directory

    tokenizer = AutoTokenizer.from_pretrained(model_directory())

    def kept(path: str, prompt: str) -> list[int]:
        results = json.loads((ROOT / path).read_text())["results"]
        rows = next(result["rows"] for result in results if result["prompt"] == prompt)
        return next(row["tokens"] for row in rows if row["row"] == "kvlab plain")

    return {"doc-4k": (document_token_ids(tokenizer, 4096), kept("docs/peers-plain.json", "doc-4k")),
            "summary-6k": (long_summary_prompt_ids(tokenizer), kept("docs/peers-summary-6k.json", "summary-6k"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-ngram", type=int, default=PromptLookup().max_ngram, help="longest n-gram matched")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    lookup = PromptLookup(max_ngram=args.max_ngram)
    results = {name: replay(prompt, output, lookup, args.num_draft_tokens)
               for name, (prompt, output) in cases().items()}
    print("| prompt | matched n-gram | steps | first draft right | drafts accepted per step |")
    print("|---|---|---|---|---|")
    for name, by_ngram in results.items():
        for ngram, row in by_ngram.items():
            print(f"| {name} | {ngram} | {row['steps']} | {row['first_right_fraction']:.0%} | "
                  f"{row['accepted_per_step']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"num_draft_tokens": args.num_draft_tokens, "max_ngram": args.max_ngram,
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()
