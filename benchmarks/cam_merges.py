"""How much CaM's merging changes the cache, and whether its output differs from StreamingLLM's.

Usage: .venv/bin/python benchmarks/cam_merges.py [--model smollm2] [--task squad] [--context 1024]
       [--samples 3] [--ratios 0.25 0.5 0.75 0.875] [--new-tokens 24] [--merge-scale 1] [--json PATH]

CaM evicts the tokens StreamingLLM evicts (sinks plus the most recent tokens stay) and folds each
evicted value into the tokens after it, with probability min(1, A_e / mean(A_kept)). This prints,
per compression ratio: the relative L2 change of the kept values that the merges made (summed over
layers), the share of kept (head, token) values that changed, and how many greedy outputs equal
StreamingLLM's. `--merge-scale 100` multiplies what the merges add, a check that the decode reads
the merged values at all. The figures do not depend on machine load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from kvlab.bench import tasks
from kvlab.bench.runner import encode_sample
from kvlab.compress import create_compressor
from kvlab.compress.base import CompressionContext
from kvlab.compress.cam import CaMCompressor
from kvlab.engine import generate
from kvlab.generation import GenerationConfig
from kvlab.models import load_model


@dataclasses.dataclass
class MeasuredCaM(CaMCompressor):
    """CaM that adds up, over the layers it compresses, how far merging moved the kept values.

    `merge_scale` multiplies the change merging makes (1: CaM as it is).
    """

    merge_scale: float = 1.0
    changed_sq: float = 0.0
    kept_sq: float = 0.0
    values_changed: int = 0
    values_kept: int = 0

    def merge_values(
        self, values: torch.Tensor, kept_mask: torch.Tensor, context: CompressionContext, keys: torch.Tensor
    ) -> torch.Tensor:
        merged = super().merge_values(values, kept_mask, context, keys)
        if self.merge_scale != 1.0:
            merged = (values.float() + self.merge_scale * (merged.float() - values.float())).to(values.dtype)
        kept = kept_mask[..., None]
        delta = (merged.float() - values.float()) * kept
        self.changed_sq += float(delta.square().sum())
        self.kept_sq += float((values.float() * kept).square().sum())
        self.values_changed += int(((delta != 0).any(dim=-1) & kept_mask).sum())
        self.values_kept += int(kept_mask.sum())
        return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="squad")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.875])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--merge-scale", type=float, default=1.0, help="multiply what the merges add")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    loaded = load_model(args.model)
    task = tasks.from_dict({"name": args.task, "context_tokens": args.context, "max_new_tokens": args.new_tokens})
    prompts = [encode_sample(loaded, sample) for sample in task.load(loaded.tokenizer, args.samples).samples]
    config = GenerationConfig(max_new_tokens=args.new_tokens)
    rows = []
    print(
        f"{args.model}, {args.task}, merge scale {args.merge_scale:g}, {len(prompts)} prompts of "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    )
    print("ratio | kept values changed by merging | relative L2 change of kept values | outputs equal to StreamingLLM")
    for ratio in args.ratios:
        cam = MeasuredCaM(compression_ratio=ratio, merge_scale=args.merge_scale)
        equal = 0
        for prompt in prompts:
            streaming = generate(
                loaded, [prompt], config, compressor=create_compressor("streamingllm", compression_ratio=ratio)
            )
            merged = generate(loaded, [prompt], config, compressor=cam)
            equal += streaming.requests[0].token_ids == merged.requests[0].token_ids
        row = {
            "ratio": ratio,
            "kept_values_changed": cam.values_changed / max(cam.values_kept, 1),
            "relative_l2_change": (cam.changed_sq / max(cam.kept_sq, 1e-30)) ** 0.5,
            "outputs_equal_to_streamingllm": equal,
            "outputs": len(prompts),
        }
        rows.append(row)
        print(
            f"{ratio:g} | {row['kept_values_changed']:.1%} | {row['relative_l2_change']:.2e} | {equal}/{len(prompts)}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"model": args.model, "task": args.task, "merge_scale": args.merge_scale, "rows": rows}, indent=2
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
