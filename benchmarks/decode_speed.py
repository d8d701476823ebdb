"""Prefill and decode speed of kvlab's plain engine vs transformers `generate`, measured in one run.

Usage: .venv/bin/python benchmarks/decode_speed.py [--contexts 512 2048 8064] [--new-tokens 32] [--repeats 3]

For each context length both engines decode the same greedy continuation of the bundled document;
runs alternate between the engines and the median is reported. The last column is kvlab's decode
time per token divided by transformers' (below 1 means kvlab is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers.generation.streamers import BaseStreamer

from kvlab.data import document_token_ids
from kvlab.engine import generate
from kvlab.generation import GenerationConfig
from kvlab.models import LoadedModel, load_model


class _TokenClock(BaseStreamer):
    """Timestamps the tokens transformers' `generate` emits (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_kvlab(loaded: LoadedModel, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill tokens/s, decode ms/token, generated ids) of kvlab's engine."""
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    output = generate(loaded, [prompt], config)
    stats = output.stats
    return len(prompt) / stats.ttft_s, 1000 * stats.decode_s / (new_tokens - 1), output.requests[0].token_ids


def time_transformers(loaded: LoadedModel, prompt: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill tokens/s, decode ms/token, generated ids) of transformers' `generate` with its own SDPA path."""
    config = loaded.model.config
    previous, config._attn_implementation = config._attn_implementation, "sdpa"
    clock = _TokenClock()
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            output = loaded.model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                streamer=clock,
                pad_token_id=loaded.tokenizer.pad_token_id or 0,
            )
    finally:
        config._attn_implementation = previous
    first_token, last_token = clock.times[1], clock.times[-1]
    decode_ms = 1000 * (last_token - first_token) / (new_tokens - 1)
    return len(prompt) / (first_token - start), decode_ms, output[0, len(prompt) :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8064])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    loaded = load_model()
    warmup = document_token_ids(loaded.tokenizer, 64)
    time_kvlab(loaded, warmup, 4)
    time_transformers(loaded, warmup, 4)
    rows = []
    for context in args.contexts:
        prompt = document_token_ids(loaded.tokenizer, context)
        kvlab_runs, hf_runs = [], []
        for _ in range(args.repeats):
            kvlab_runs.append(time_kvlab(loaded, prompt, args.new_tokens))
            hf_runs.append(time_transformers(loaded, prompt, args.new_tokens))
        kvlab_decode = statistics.median(run[1] for run in kvlab_runs)
        hf_decode = statistics.median(run[1] for run in hf_runs)
        rows.append(
            {
                "context": context,
                "kvlab_prefill_tok_s": statistics.median(run[0] for run in kvlab_runs),
                "hf_prefill_tok_s": statistics.median(run[0] for run in hf_runs),
                "kvlab_decode_ms": kvlab_decode,
                "hf_decode_ms": hf_decode,
                "decode_ratio": kvlab_decode / hf_decode,
                "identical_tokens": all(run[2] == hf_runs[0][2] for run in kvlab_runs + hf_runs),
            }
        )
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return
    print(f"embedded SmolLM2-135M, fp32, {torch.get_num_threads()} threads, {args.new_tokens} new tokens, "
          f"median of {args.repeats}, load avg {os.getloadavg()[0]:.2f}")
    print(
        "| context | prefill tok/s kvlab | prefill tok/s HF | decode ms/tok kvlab | decode ms/tok HF "
        "| kvlab/HF decode | same tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['context']} | {row['kvlab_prefill_tok_s']:.0f} | {row['hf_prefill_tok_s']:.0f} | "
            f"{row['kvlab_decode_ms']:.1f} | {row['hf_decode_ms']:.1f} | {row['decode_ratio']:.3f} | "
            f"{'yes' if row['identical_tokens'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
