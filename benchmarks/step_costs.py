"""What one forward costs on this machine: the numbers that bound lossless decoding's speed-up.

Usage: .venv/bin/python benchmarks/step_costs.py [--context 8064] [--draft-length 8] [--repeats 5]

Prints the median time of: a plain decode step on the full cache; a draft step on a SnapKV-10%
cache (fp32 weights and int8 dynamic-quantized weights); a verify pass over `--draft-length` + 1
tokens on the full cache; and the time attention and the linear layers take inside a plain step
(torch profiler). With perfect acceptance, lossless decoding emits k + 1 tokens per k draft steps and
one verify pass, so (k + 1) * plain / (k * draft + verify) is its ceiling; the script prints it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.cache import KVCache, forward
from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.generation.prefill import prefill
from kvlab.models import LoadedModel, load_model
from kvlab.models.draft_weights import draft_model


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8064)
    parser.add_argument("--draft-length", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    loaded = load_model()
    document = document_token_ids(loaded.tokenizer, args.context + args.draft_length + 1)
    prompt, following = document[: args.context], document[args.context :]
    capacity = args.context + args.draft_length + 2
    full, draft, _ = prefill(loaded, [prompt], capacity, drafter=create_compressor("snapkv", compression_ratio=0.9))
    assert draft is not None
    model = loaded.model
    plain = step_ms(model, loaded, full, following[:1], args.repeats)
    draft_fp32 = step_ms(model, loaded, draft, following[:1], args.repeats)
    draft_int8 = step_ms(draft_model(model, "int8"), loaded, draft, following[:1], args.repeats)
    verify = step_ms(model, loaded, full, following[: args.draft_length + 1], args.repeats)

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step_ms(model, loaded, full, following[:1], 2)
    self_ms = {event.key: event.self_cpu_time_total / 1e3 / 3 for event in profiler.key_averages()}
    attention = sum(ms for key, ms in self_ms.items() if "scaled_dot_product" in key)
    linear = sum(ms for key, ms in self_ms.items() if key in ("aten::mm", "aten::addmm"))

    k = args.draft_length
    print(f"embedded SmolLM2-135M, fp32, context {args.context}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("| forward | ms |")
    print("|---|---|")
    print(f"| plain decode step (full cache) | {plain:.1f} |")
    print(f"| ... of which attention (profiler) | {attention:.1f} |")
    print(f"| ... of which linear layers (profiler) | {linear:.1f} |")
    print(f"| draft step, SnapKV-10% cache, fp32 weights | {draft_fp32:.1f} |")
    print(f"| draft step, SnapKV-10% cache, int8 dynamic weights | {draft_int8:.1f} |")
    print(f"| verify pass over {k} + 1 tokens (full cache) | {verify:.1f} |")
    for name, draft_cost in (("fp32", draft_fp32), ("int8", draft_int8)):
        ceiling = (k + 1) * plain / (k * draft_cost + verify)
        limit = plain / draft_cost
        print(f"ceiling with {name} drafts, every draft accepted: {ceiling:.2f}x at k={k}, {limit:.2f}x as k grows")


if __name__ == "__main__":
    main()
