"""How close each forward runs to this machine's limits: time, bytes moved, FLOPs and the fraction of its bound.

Usage: .venv/bin/python benchmarks/roofline.py [--contexts 4096 8064] [--batches 1 4 8]
           [--verify-tokens 8 16] [--repeats 7] [--with-transformers-forward]
           [--with-compiled-forward] [--json PATH]

First the machine's own limits, measured with torch on the threads it runs with: the streaming
bandwidth (summing a 512 MB float32 tensor), the rate a float32 matrix-vector product reads its matrix,
and float32, bfloat16 and int8 matrix-multiply rates. Then the embedded SmolLM2's forwards as the
engine runs them (`kvlab.cache.run_packed`, one segment per sequence), alternating within each repeat
so drift on a shared machine hits every row alike:
- plain decode steps at each context and batch (each sequence's cache a copy of one prefilled prompt);
- a step at a 16-token context (the weights alone: attention over 16 keys costs nothing), which splits a
  plain step into its linear layers and its attention;
- the linear layers alone, called in turn on one row (what the weights cost through their kernels; the
  16-token step minus this is the forward's other work: norms, rotary, attention's host side);
- verifies of 1 + k tokens at the longest context;
- draft steps at the longest context: SnapKV-10% caches with the served float32, bf16, int8 and int4
  weights, KIVI-4 and TurboQuant-4 caches with the served weights;
- with `--with-transformers-forward`, the weights-only step and the longest batch-1 plain step through
  transformers' own forward over unfused packed weights (kvlab's forward before `kvlab.models.decoder_forward`);
- with `--with-compiled-forward`, the weights-only step, the longest context's plain steps (batch 1 and the
  largest), its verifies and SnapKV-10% draft steps (fp32, bf16, int4 weights) through the lean forward
  compiled as one graph (`kvlab.models.compiled_forward`), interleaved with the eager rows; their
  `vs plain step` is against the compiled plain step.

Bytes moved: the linear layers' weights once per forward (as stored: 4, 2 or 1 bytes a weight) plus the
keys and values every segment's attention reads (a quantized cache's working copy, as it is read today).
FLOPs: 2 per weight per token fed, plus 4 * query heads * head_dim per (query, key) pair of attention.
The bound of a forward is the larger of bytes / streaming bandwidth and FLOPs / the matmul rate of its
weights' dtype; `of bound` is bound / measured (1.0 would be at the machine's limit). The bandwidth this
shared machine gives moves by up to 2x within minutes, so it is measured again before each repeat's
forwards (best of three sums) and each repeat's forwards are held to it: `of bound` is the median over
the repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvlab.cache import KVCache, Segment, run_packed
from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.generation.prefill import PrefillCaches, prefill
from kvlab.models import LoadedModel, load_model
from kvlab.models.decoder_forward import use_transformers_forward
from kvlab.models.draft_weights import draft_model
from kvlab.models.packed_linear import ProjectionSlice, pack_linear_layers

sys.path.insert(0, str(Path(__file__).parent))
from lossless_decode import attended_bytes, linear_weight_bytes, warm_up_decode_attention

STREAM_BYTES = 512 * 2**20
WEIGHTS_ONLY_CONTEXT = 16


@dataclasses.dataclass(slots=True)
class Limits:
    """The machine's measured limits (GB/s and GFLOP/s)."""

    matvec_gbps: float
    fp32_gflops: float
    bf16_gflops: float
    int8_gops: float | None  # None: no int8 matmul kernel on this build
    stream_samples_gbps: list[float] = dataclasses.field(default_factory=list)  # one per repeat, before its forwards

    @property
    def stream_gbps(self) -> float:
        """The streaming bandwidth over the run: the median of the repeats' own samples."""
        return statistics.median(self.stream_samples_gbps)

    def matmul_gflops(self, bytes_per_weight: float) -> float:
        """The matmul rate of weights stored in `bytes_per_weight` bytes each: bf16 (2), int8 (1, where the
        build has an int8 kernel), else float32 (int4 codes are expanded to float32 by the kernel)."""
        if bytes_per_weight == 2:
            return self.bf16_gflops
        if bytes_per_weight == 1 and self.int8_gops is not None:
            return self.int8_gops
        return self.fp32_gflops


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def median_s(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    return statistics.median(_timed(run) for _ in range(repeats))


def measure_limits(repeats: int) -> Limits:
    # The streaming bandwidth is sampled before each repeat's forwards instead (`main`).
    matrix, vector = torch.randn(8192, 8192), torch.randn(8192)
    matvec_s = median_s(lambda: torch.mv(matrix, vector), repeats)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    fp32_s = median_s(lambda: a @ b, repeats)
    a16, b16 = a.bfloat16(), b.bfloat16()
    bf16_s = median_s(lambda: a16 @ b16, repeats)
    int8_gops = None
    try:
        a8 = torch.randint(-128, 127, (n, n), dtype=torch.int8)
        b8 = torch.randint(-128, 127, (n, n), dtype=torch.int8)
        int8_gops = 2 * n**3 / median_s(lambda: torch._int_mm(a8, b8), repeats) / 1e9
    except RuntimeError:
        pass
    return Limits(
        matvec_gbps=8192 * 8192 * 4 / matvec_s / 1e9,
        fp32_gflops=2 * n**3 / fp32_s / 1e9,
        bf16_gflops=2 * n**3 / bf16_s / 1e9,
        int8_gops=int8_gops,
    )


@dataclasses.dataclass(slots=True)
class Forward:
    """One forward to time: a model over segments, each feeding `num_tokens` after its cache."""

    name: str
    model: torch.nn.Module
    caches: list[KVCache]
    num_tokens: int
    tokens: list[int]
    context: int
    samples: list[float] = dataclasses.field(default_factory=list)

    def run(self) -> float:
        segments = [Segment(cache, self.num_tokens) for cache in self.caches]
        token_ids = [self.tokens[: self.num_tokens]] * len(self.caches)
        logits_at = [self.num_tokens * (i + 1) - 1 for i in range(len(self.caches))]
        for cache in self.caches:
            cache.set_provisional(True)
        start = time.perf_counter()
        run_packed(self.model, segments, token_ids, logits_at)  # type: ignore[arg-type]
        seconds = time.perf_counter() - start
        for cache in self.caches:
            cache.drop_last(self.num_tokens)
            cache.set_provisional(False)
        return seconds

    def bytes_moved(self) -> int:
        return linear_weight_bytes(self.model) + sum(attended_bytes(cache) for cache in self.caches)

    def flops(self, loaded: LoadedModel) -> int:
        config = loaded.model.config
        weights = sum(module.in_features * module.out_features for module in _linears(self.model))
        heads, head_dim = config.num_attention_heads, config.head_dim
        pairs = sum(_attended_keys(cache) * self.num_tokens for cache in self.caches)
        return 2 * weights * self.num_tokens * len(self.caches) + 4 * heads * head_dim * pairs


@dataclasses.dataclass(slots=True)
class LinearsOnly(Forward):
    """Every linear layer of a forward called in turn on one token's row, nothing else: the time the
    weights take through their kernels (from memory: the layers together are far larger than the
    caches), so a step's time minus this is its other work."""

    def run(self) -> float:
        layers = _linears(self.model)
        rows = {layer.in_features: torch.randn(1, layer.in_features) for layer in layers}
        with torch.inference_mode():
            start = time.perf_counter()
            for layer in layers:
                layer(rows[layer.in_features])
            return time.perf_counter() - start

    def bytes_moved(self) -> int:
        return linear_weight_bytes(self.model)

    def flops(self, loaded: LoadedModel) -> int:
        return 2 * sum(module.in_features * module.out_features for module in _linears(self.model))


def _linears(model: torch.nn.Module) -> list[Any]:
    """Every linear layer a forward runs: a fused projection counts once, its parts not at all."""
    return [m for m in model.modules()
            if hasattr(m, "in_features") and hasattr(m, "out_features") and not isinstance(m, ProjectionSlice)]


def _attended_keys(cache: KVCache) -> int:
    """Keys a new query attends to, summed over layers (a sliding-window layer reads its window)."""
    total = 0
    for layer in cache.layers:
        window = layer.sliding_window
        total += sum(length if window is None else min(length, window) for length in layer.lengths)  # type: ignore[attr-defined]
    return total


def _bytes_per_weight(model: torch.nn.Module) -> float:
    """Bytes per stored weight of the model's linear layers: 4 fp32, 2 bf16, 1 int8, 0.5625 int4 (codes and
    a bfloat16 scale and mid per group of 64), rounded to a quarter byte."""
    linears = _linears(model)
    return round(4 * linear_weight_bytes(model) / sum(m.in_features * m.out_features for m in linears)) / 4


def build_forwards(loaded: LoadedModel, args: argparse.Namespace) -> list[Forward]:
    model = loaded.model
    longest = max(args.contexts)
    document = document_token_ids(loaded.tokenizer, longest + max(args.verify_tokens) + 1)
    following = document[longest:]
    forwards = []
    for context in sorted(args.contexts):
        capacity = context + max(args.verify_tokens) + 2
        full, _, _ = prefill(loaded, [document[:context]], PrefillCaches(capacity))
        for batch in args.batches:
            caches = [full] + [full.clone() for _ in range(batch - 1)]
            name = f"plain step, {context} context, batch {batch}"
            forwards.append(Forward(name, model, caches, 1, following, context))
        if context == longest:
            for k in args.verify_tokens:
                name = f"verify 1 + {k} tokens, {context} context"
                forwards.append(Forward(name, model, [full], k + 1, following, context))
    small, _, _ = prefill(loaded, [document[:WEIGHTS_ONLY_CONTEXT]], PrefillCaches(WEIGHTS_ONLY_CONTEXT + 2))
    forwards.append(Forward(f"step at {WEIGHTS_ONLY_CONTEXT} context (weights only)", model, [small], 1, following,
                            WEIGHTS_ONLY_CONTEXT))
    forwards.append(LinearsOnly("linear layers alone, 1 token", model, [small], 1, following, WEIGHTS_ONLY_CONTEXT))
    if args.with_transformers_forward:
        # The same weights packed but not fused, through transformers' own forward: what the lean
        # forward replaced, timed beside it.
        reference = load_model(packed_weights=False).model
        pack_linear_layers(reference)
        use_transformers_forward(reference)
        forwards.append(Forward(f"step at {WEIGHTS_ONLY_CONTEXT} context, transformers' forward", reference, [small],
                                1, following, WEIGHTS_ONLY_CONTEXT))
        forwards.append(Forward(f"plain step, {longest} context, batch 1, transformers' forward", reference,
                                [full], 1, following, longest))  # `full`: the longest context's cache
    capacity = longest + 2
    prompt = document[:longest]
    snapkv_drafter = create_compressor("snapkv", compression_ratio=0.9)
    snapkv = prefill(loaded, [prompt], PrefillCaches(capacity, drafter=snapkv_drafter))[1]
    assert snapkv is not None
    if args.with_compiled_forward:
        forwards += compiled_forwards(forwards, snapkv, max(args.batches))
    for weights in ("same", "bf16", "int8", "int4"):
        drafter = draft_model(model, weights)  # type: ignore[arg-type]
        label = "fp32" if weights == "same" else weights
        forwards.append(Forward(f"draft step, SnapKV-10%, {label} weights, {longest}", drafter, [snapkv], 1, following,
                                longest))
        if weights in ("int8", "int4"):
            forwards.append(LinearsOnly(f"linear layers alone, {label} weights, 1 token", drafter, [small], 1,
                                        following, WEIGHTS_ONLY_CONTEXT))
    for name in ("kivi", "turboquant"):
        cache = prefill(loaded, [prompt], PrefillCaches(capacity, drafter=create_compressor(name, bits=4)))[1]
        assert cache is not None
        label = f"draft step, {name}-4, fp32 weights, {longest}"
        forwards.append(Forward(label, model, [cache], 1, following, longest))
    return forwards


def compiled_forwards(eager: list[Forward], snapkv: KVCache, batch: int) -> list[Forward]:
    """The same forwards through the lean forward compiled as one graph (`kvlab.models.compiled_forward`),
    over the same caches: the weights-only step, the longest context's plain steps at batch 1 and
    `batch`, its verifies, and SnapKV-10% draft steps with fp32, bf16 and int4 weights."""
    model = load_model(compile_forward=True).model
    longest = max(forward.context for forward in eager)
    wanted = ("step at", f"plain step, {longest} context, batch 1", f"plain step, {longest} context, batch {batch}",
              "verify")
    forwards = [dataclasses.replace(forward, name=f"{forward.name}, compiled", model=model, samples=[])
                for forward in eager if type(forward) is Forward and forward.name.startswith(wanted)
                and "transformers" not in forward.name]
    following = eager[0].tokens
    for weights in ("same", "bf16", "int4"):
        label = "fp32" if weights == "same" else weights
        forwards.append(Forward(f"draft step, SnapKV-10%, {label} weights, {longest}, compiled",
                                draft_model(model, weights), [snapkv], 1, following, longest))  # type: ignore[arg-type]
    return forwards


def report_rows(forwards: list[Forward], loaded: LoadedModel, limits: Limits) -> list[dict[str, object]]:
    """Each forward's median time, bytes, FLOPs, bound and fraction of it; plain steps and verifies also
    their attention (and whatever else grows with context: the step minus the weights-only step), and
    every row its time over one sequence's plain step at its context (what a round of drafts must beat).
    Rows of the compiled forward are held to its own plain and weights-only steps."""
    weights_only_ms = {_compiled(f): 1e3 * statistics.median(f.samples) for f in forwards if "weights only" in f.name}
    plain_ms = {(f.context, _compiled(f)): 1e3 * statistics.median(f.samples) for f in forwards
                if f.name.startswith("plain") and len(f.caches) == 1 and "transformers" not in f.name}
    rows = []
    for forward in forwards:
        ms = 1e3 * statistics.median(forward.samples)
        plain = plain_ms.get((forward.context, _compiled(forward)))
        nbytes, flops = forward.bytes_moved(), forward.flops(loaded)
        rate = limits.matmul_gflops(_bytes_per_weight(forward.model))
        # Each repeat's bound from the bandwidth measured just before it; the fraction is the median of
        # bound / time over the repeats.
        bounds = [max(nbytes / (stream * 1e6), flops / (rate * 1e6)) for stream in limits.stream_samples_gbps]
        bound_ms = statistics.median(bounds)
        fraction = statistics.median(bound / (1e3 * t) for bound, t in zip(bounds, forward.samples, strict=True))
        rows.append({
            "forward": forward.name, "ms": ms, "bytes_moved": nbytes, "mb_moved": nbytes / 1e6, "flops": flops,
            "gflop": flops / 1e9, "gbps": nbytes / ms / 1e6, "bound_ms": bound_ms, "fraction_of_bound": fraction,
            "vs_plain_step": None if plain is None else ms / plain,
            "attention_ms": ms - weights_only_ms[_compiled(forward)]
            if forward.name.startswith(("plain", "verify")) and "transformers" not in forward.name else None,
        })
    return rows


def _compiled(forward: Forward) -> bool:
    return forward.name.endswith(", compiled")


def _format(value: object, spec: str, unit: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8064])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--verify-tokens", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--with-transformers-forward", action="store_true",
                        help="also time the weights-only and the longest batch-1 plain step through transformers' "
                             "own forward with unfused packed weights (what kvlab ran before its lean forward)")
    parser.add_argument("--with-compiled-forward", action="store_true",
                        help="also time the weights-only step, the longest context's plain steps and verifies and "
                             "SnapKV draft steps through the forward compiled as one graph (load_model(compile_forward"
                             "=True); compiling takes minutes before anything is timed)")
    parser.add_argument("--json", type=Path, help="also write the limits and rows to this JSON file")
    args = parser.parse_args()

    limits = measure_limits(args.repeats)
    loaded = load_model()
    warm_up_decode_attention(loaded)  # compile before anything is timed
    forwards = build_forwards(loaded, args)
    for forward in forwards:
        forward.run()  # warm-up: the first forward of each shape runs slower
    stream = torch.ones(STREAM_BYTES // 4)
    for _ in range(args.repeats):
        # The bandwidth this shared machine gives right now (it moves by 2x within minutes): each repeat's
        # rows are held to the best of three sums taken just before them.
        limits.stream_samples_gbps.append(STREAM_BYTES / min(_timed(stream.sum) for _ in range(3)) / 1e9)
        for forward in forwards:
            forward.samples.append(forward.run())

    header = (
        f"embedded SmolLM2-135M, fp32, {torch.get_num_threads()} threads, median of {args.repeats}, "
        f"load avg {os.getloadavg()[0]:.2f}"
    )
    print(header)
    print(
        f"machine: stream {limits.stream_gbps:.1f} GB/s (repeats {min(limits.stream_samples_gbps):.1f} to "
        f"{max(limits.stream_samples_gbps):.1f}), fp32 matrix-vector {limits.matvec_gbps:.1f} GB/s, "
        f"fp32 GEMM {limits.fp32_gflops:.0f} GFLOP/s, bf16 GEMM {limits.bf16_gflops:.0f} GFLOP/s, "
        f"int8 GEMM {'n/a' if limits.int8_gops is None else f'{limits.int8_gops:.0f} GOP/s'}"
    )
    rows = report_rows(forwards, loaded, limits)
    print("| forward | ms | vs plain step | MB moved | GFLOP | GB/s | bound ms | of bound | attention ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['forward']} | {row['ms']:.1f} | {_format(row['vs_plain_step'], '.2f', 'x')} | "
              f"{row['mb_moved']:.0f} | {row['gflop']:.2f} | {row['gbps']:.1f} | {row['bound_ms']:.1f} | "
              f"{row['fraction_of_bound']:.2f} | {_format(row['attention_ms'], '.1f')} |")
    if args.json:
        payload = {"header": header, "threads": torch.get_num_threads(), "repeats": args.repeats,
                   "limits": {**dataclasses.asdict(limits), "stream_gbps": limits.stream_gbps}, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
