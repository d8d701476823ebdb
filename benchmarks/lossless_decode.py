"""Lossless decoding vs plain full-KV decoding vs lossy decoding, measured in one run.

Usage: .venv/bin/python benchmarks/lossless_decode.py [--contexts 2048 8064] [--new-tokens 128]
           [--batch 1] [--settings LABEL ...]

For each context, every setting decodes the same greedy continuation of the bundled document; the
table gives decode tokens/s, the speed-up over plain full-KV decoding, the mean acceptance length
(accepted drafts + 1 per round), and whether the output is identical to plain decoding. The
MagicDec-style row drafts 3 tokens from a StreamingLLM cache.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.generation import GenerationConfig, GenerationOutput, generate
from kvlab.lossless import LosslessConfig, generate_lossless
from kvlab.models import LoadedModel, load_model

# (label, mode, compressor name, compressor params, draft length, draft weights)
SETTINGS: list[tuple[str, str, str | None, dict[str, object], int | str, str]] = [
    ("plain full KV", "full", None, {}, 0, "same"),
    ("lossy snapkv-0.9", "lossy", "snapkv", {"compression_ratio": 0.9}, 0, "same"),
    ("lossy kivi-2", "lossy", "kivi", {"bits": 2}, 0, "same"),
    ("lossless snapkv-0.9 k=auto", "lossless", "snapkv", {"compression_ratio": 0.9}, "auto", "same"),
    ("lossless snapkv-0.9 k=8", "lossless", "snapkv", {"compression_ratio": 0.9}, 8, "same"),
    ("lossless snapkv-0.9 k=32", "lossless", "snapkv", {"compression_ratio": 0.9}, 32, "same"),
    ("lossless kivi-4 k=32", "lossless", "kivi", {"bits": 4}, 32, "same"),
    ("lossless snapkv-0.9 k=auto int8 drafter", "lossless", "snapkv", {"compression_ratio": 0.9}, "auto", "int8"),
    ("lossless kivi-4 k=auto int8 drafter", "lossless", "kivi", {"bits": 4}, "auto", "int8"),
    ("MagicDec-style streamingllm-0.9 k=3", "lossless", "streamingllm", {"compression_ratio": 0.9}, 3, "same"),
]


def run(loaded: LoadedModel, prompts: list[list[int]], setting: tuple, new_tokens: int) -> GenerationOutput:  # type: ignore[type-arg]
    _, mode, name, params, draft_length, draft_weights = setting
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    compressor = create_compressor(name, **params) if name else None
    if mode == "lossless":
        assert compressor is not None
        return generate_lossless(
            loaded, prompts, config, LosslessConfig(compressor, draft_length, draft_weights=draft_weights)
        )
    return generate(loaded, prompts, config, compressor=compressor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8064])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together (different offsets)")
    parser.add_argument("--settings", nargs="*", help="labels to run (plain full KV always runs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    loaded = load_model()
    run(loaded, [document_token_ids(loaded.tokenizer, 128)], SETTINGS[3], 8)
    results = []
    for context in args.contexts:
        document = document_token_ids(loaded.tokenizer, context + 64 * args.batch)
        prompts = [document[64 * row : 64 * row + context] for row in range(args.batch)]
        baseline = None
        for setting in SETTINGS:
            if args.settings and setting[0] not in args.settings and setting[1] != "full":
                continue
            output = run(loaded, prompts, setting, args.new_tokens)
            tokens = [request.token_ids for request in output.requests]
            if baseline is None:
                baseline = (output.stats.decode_tokens_per_s, tokens)
            results.append(
                {
                    "context": context,
                    "setting": setting[0],
                    "decode_tokens_per_s": output.stats.decode_tokens_per_s,
                    "speedup": output.stats.decode_tokens_per_s / baseline[0],
                    "acceptance_length": output.lossless.acceptance_length if output.lossless else None,
                    "mean_draft_length": (
                        sum(output.lossless.num_draft_tokens_per_round) / len(output.lossless.num_draft_tokens_per_round) if output.lossless else None
                    ),
                    "identical_to_plain": tokens == baseline[1],
                }
            )
    if args.json:
        print(json.dumps({"batch": args.batch, "threads": torch.get_num_threads(), "rows": results}, indent=2))
        return
    print(
        f"embedded SmolLM2-135M, fp32, batch {args.batch}, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, load avg {os.getloadavg()[0]:.2f}"
    )
    print("| context | setting | decode tok/s | vs plain | acceptance length | mean draft length | identical to plain |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        acceptance = f"{row['acceptance_length']:.1f}" if row["acceptance_length"] else "-"
        draft = f"{row['mean_draft_length']:.1f}" if row["mean_draft_length"] else "-"
        print(
            f"| {row['context']} | {row['setting']} | {row['decode_tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
            f"{acceptance} | {draft} | {'yes' if row['identical_to_plain'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
