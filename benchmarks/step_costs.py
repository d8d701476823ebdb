"""What one forward costs on this machine: the numbers that bound lossless decoding's speed-up.

Usage: .venv/bin/python benchmarks/step_costs.py [--context 8064] [--num-draft-tokens 8] [--repeats 9] [--json PATH]

Prints the median time of: a plain decode step on the full cache (also through the engine's packed
forward, and with transformers' own `F.linear` layers instead of kvlab's oneDNN-packed ones); a draft
step on a SnapKV-10% cache (fp32, bf16 and int8 dynamic-quantized weights) and on KIVI-4 and
TurboQuant-4 caches as the lossless engine runs it (a packed forward); a verify forward over
`--num-draft-tokens` + 1 tokens on the full cache, as the engine runs it (GQA-folded scores, causal block
masked in place), with `F.linear` layers, and through one masked attention call (the reference); the
time attention and the linear layers take inside a plain step (torch profiler); and, per forward, the
bytes it reads (linear weights + the KV attention reads) and the bandwidth that implies. The forwards
alternate within each repeat. With perfect acceptance, lossless decoding emits k + 1 tokens per k draft
steps and one verify, so (k + 1) * plain / (k * draft + verify) is its ceiling; the script prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.cache import KVCache, Segment, forward, run_packed
from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.generation.prefill import PrefillCaches, prefill
from kvlab.models import LoadedModel, load_model
from kvlab.models.draft_weights import draft_model

sys.path.insert(0, str(Path(__file__).parent))
from lossless_decode import attended_bytes, linear_weight_bytes


def step_ms(model: torch.nn.Module, loaded: LoadedModel, cache: KVCache, tokens: list[int], repeats: int) -> float:
    """Median ms of feeding `tokens` after the cache's contents (rolled back after each run)."""
    timings = []
    ids = torch.tensor([tokens], device=loaded.device)
    for _ in range(repeats + 1):
        with cache.provisional():
            start = time.perf_counter()
            forward(model, cache, ids, logits_to_keep=len(tokens))  # type: ignore[arg-type]
            timings.append(time.perf_counter() - start)
            cache.drop_last(len(tokens))
    return 1e3 * statistics.median(timings[1:])


def packed_ms(model: torch.nn.Module, loaded: LoadedModel, cache: KVCache, tokens: list[int], repeats: int) -> float:
    """`step_ms` through the lossless engine's packed forward (one segment)."""
    timings = []
    for _ in range(repeats + 1):
        with cache.provisional():
            start = time.perf_counter()
            run_packed(model, [Segment(cache, len(tokens))], [tokens], list(range(len(tokens))))  # type: ignore[arg-type]
            timings.append(time.perf_counter() - start)
            cache.drop_last(len(tokens))
    return 1e3 * statistics.median(timings[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8064)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args()

    loaded = load_model()
    # The same weights through transformers' own `F.linear` layers, to show what packing buys.
    unpacked = load_model(packed_weights=False).model
    document = document_token_ids(loaded.tokenizer, args.context + args.num_draft_tokens + 1)
    prompt, following = document[: args.context], document[args.context :]
    capacity = args.context + args.num_draft_tokens + 2
    full, draft, _ = prefill(
        loaded, [prompt], PrefillCaches(capacity, drafter=create_compressor("snapkv", compression_ratio=0.9))
    )
    assert draft is not None
    # Quantized draft caches: attention reads their dequantized working copy, not the packed codes.
    quantized = {
        name: prefill(loaded, [prompt], PrefillCaches(capacity, drafter=create_compressor(name, bits=4)))[1]
        for name in ("kivi", "turboquant")
    }
    model = loaded.model
    k = args.num_draft_tokens
    # Forwards alternate within each repeat, so drift on a shared machine hits every one alike.
    forwards = {
        "plain": lambda: step_ms(model, loaded, full, following[:1], 1),
        "plain_engine": lambda: packed_ms(model, loaded, full, following[:1], 1),
        "plain_unpacked": lambda: step_ms(unpacked, loaded, full, following[:1], 1),
        "same": lambda: packed_ms(model, loaded, draft, following[:1], 1),
        "bf16": lambda: packed_ms(draft_model(model, "bf16"), loaded, draft, following[:1], 1),
        "int8": lambda: packed_ms(draft_model(model, "int8"), loaded, draft, following[:1], 1),
        "kivi": lambda: packed_ms(model, loaded, quantized["kivi"], following[:1], 1),  # type: ignore[arg-type]
        "turboquant": lambda: packed_ms(model, loaded, quantized["turboquant"], following[:1], 1),  # type: ignore[arg-type]
        "verify": lambda: packed_ms(model, loaded, full, following[: k + 1], 1),
        "verify_masked": lambda: step_ms(model, loaded, full, following[: k + 1], 1),
        "verify_unpacked": lambda: packed_ms(unpacked, loaded, full, following[: k + 1], 1),
    }
    samples: dict[str, list[float]] = {name: [] for name in forwards}
    for _ in range(args.repeats):
        for name, measure in forwards.items():
            samples[name].append(measure())
    median = {name: statistics.median(values) for name, values in samples.items()}
    plain, verify, verify_masked = median["plain"], median["verify"], median["verify_masked"]
    drafts = {weights: median[weights] for weights in ("same", "bf16", "int8")}

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step_ms(model, loaded, full, following[:1], 2)
    self_ms = {event.key: event.self_cpu_time_total / 1e3 / 3 for event in profiler.key_averages()}
    attention = sum(ms for key, ms in self_ms.items() if "scaled_dot_product" in key)
    linear = sum(ms for key, ms in self_ms.items() if key in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"))

    weights = linear_weight_bytes(model)
    full_kv, draft_kv = attended_bytes(full), attended_bytes(draft)
    rows = [
        ("plain decode step (full cache)", plain, weights + full_kv),
        ("plain decode step, engine path (packed forward)", median["plain_engine"], weights + full_kv),
        ("plain decode step, transformers' F.linear layers", median["plain_unpacked"], weights + full_kv),
        ("draft step, SnapKV-10% cache, fp32 weights", drafts["same"], weights + draft_kv),
        (
            "draft step, SnapKV-10% cache, bf16 weights",
            drafts["bf16"],
            linear_weight_bytes(draft_model(model, "bf16")) + draft_kv,
        ),
        (
            "draft step, SnapKV-10% cache, int8 dynamic weights",
            drafts["int8"],
            linear_weight_bytes(draft_model(model, "int8")) + draft_kv,
        ),
        (
            "draft step, KIVI-4 cache (attends its fp32 working copy)",
            median["kivi"],
            weights + attended_bytes(quantized["kivi"]),  # type: ignore[arg-type]
        ),
        (
            "draft step, TurboQuant-4 cache (attends its fp32 working copy)",
            median["turboquant"],
            weights + attended_bytes(quantized["turboquant"]),  # type: ignore[arg-type]
        ),
        (f"verify of {k} + 1 tokens, engine path (folded scores)", verify, weights + full_kv),
        (f"verify of {k} + 1 tokens, one masked attention call", verify_masked, weights + full_kv),
        (f"verify of {k} + 1 tokens, engine path, F.linear layers", median["verify_unpacked"], weights + full_kv),
    ]
    print(
        f"embedded SmolLM2-135M, fp32, context {args.context}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats}, load avg {os.getloadavg()[0]:.2f}"
    )
    print("| forward | ms | vs plain step | MB read | GB/s |")
    print("|---|---|---|---|---|")
    for name, ms, nbytes in rows:
        print(f"| {name} | {ms:.1f} | {ms / plain:.2f}x | {nbytes / 1e6:.0f} | {nbytes / ms / 1e6:.1f} |")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "context": args.context,
                    "threads": torch.get_num_threads(),
                    "repeats": args.repeats,
                    "rows": [
                        {"forward": name, "ms": ms, "vs_plain_step": ms / plain, "bytes_read": nbytes}
                        for name, ms, nbytes in rows
                    ],
                },
                indent=2,
            )
        )
    for name in ("kivi", "turboquant"):
        stored = quantized[name].nbytes()  # type: ignore[union-attr]
        print(f"{name}-4 stores {stored / 1e6:.0f} MB of KV (the full cache {full.nbytes() / 1e6:.0f} MB)")
    print(f"| ... plain step: attention (profiler) | {attention:.1f} | | | |")
    print(f"| ... plain step: linear layers (profiler) | {linear:.1f} | | | |")
    for name, draft_cost in (("fp32", drafts["same"]), ("bf16", drafts["bf16"]), ("int8", drafts["int8"])):
        ceiling = (k + 1) * plain / (k * draft_cost + verify)
        limit = plain / draft_cost
        print(f"ceiling with {name} drafts, every draft accepted: {ceiling:.2f}x at k={k}, {limit:.2f}x as k grows")


if __name__ == "__main__":
    main()
