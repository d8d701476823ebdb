"""Rate against fidelity: every code-lossless coder at every bit width, the entropy bound, task effect.

Three measurements on the same model:

- rate: each coder x bit width on the same KV (`harness.bench_codecs`): bits per value and
  reduction against fp16 with metadata, encode/decode MB/s, reconstruction error;
- bound: the codes' entropy per channel, before and after token-to-token prediction, plus the
  metadata: what any coder with one adaptive model per channel could reach;
- task effect: prompts of a few benchmark tasks are decoded greedily from a prefix restored through
  the store at each bit width's resolution and compared with full-KV decoding (identical outputs,
  matched prefix). Every code-lossless coder of one bit width restores the same tensor, so the task
  effect belongs to the bit width, not to the coder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvlab.bench.codec.harness import BenchCase, CodecBenchStats, bench_codecs
from kvlab.bench.runner import encode_sample
from kvlab.bench.tasks import tasks
from kvlab.codec.layouts import as_tokens, to_numpy
from kvlab.codec.prediction import channel_contexts, entropy_bits, token_residuals
from kvlab.engine import generate
from kvlab.generation import GenerationConfig
from kvlab.models import LoadedModel
from kvlab.quant import kv_axis, quantize
from kvlab.store import create_store
from kvlab.store.prefix import PrefixCache, PrefixConfig

RATE_BITS = (8, 4, 3, 2)
# KVCodec's figure: 11.9x against fp16 at about 1.3 bits per value.
PAPER_BITS_PER_VALUE = 1.3
# The store resolution whose restored prefix stands for each bit width in the task columns.
RESOLUTION_OF_BITS = {8: "int8", 4: "int4-video", 3: "int3-video", 2: "int2-video"}
DEFAULT_TASKS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("variable_tracking", {"context_tokens": 1024}),
    ("niah", {"context_tokens": 1024}),
    ("squad", {}),
)
GROUP_SIZE = 128


def rate_cases(bits_list: Sequence[int] = RATE_BITS) -> list[BenchCase]:
    """Every code-lossless coder at each bit width: plain and predicted zstd, the range coder with
    per-head and per-channel contexts (the latter at <= 4 bits: 8-bit per-channel models are too
    large to learn from a chunk), and the video coder with HEVC and FFV1."""
    cases = []
    for bits in bits_list:
        cases += [
            BenchCase(f"quant_zstd {bits}-bit", "quant_zstd", {"bits": bits}),
            BenchCase(f"quant_zstd predicted {bits}-bit", "quant_zstd", {"bits": bits, "predict": "token"}),
            BenchCase(f"cachegen {bits}-bit", "cachegen", {"bits": bits}),
            BenchCase(f"video_codes hevc {bits}-bit", "video_codes", {"bits": bits, "format": "hevc"}),
            BenchCase(f"video_codes ffv1 {bits}-bit", "video_codes", {"bits": bits, "format": "ffv1"}),
        ]
        if bits <= 4:
            cases.insert(-2, BenchCase(f"cachegen per-channel {bits}-bit", "cachegen",
                                       {"bits": bits, "context": "channel"}))
    return cases


@dataclasses.dataclass(frozen=True)
class EntropyBound:
    """Bits per value of one bit width's codes, keys and values averaged.

    Attributes:
        bits: Code width.
        codes: `H(code | channel)`: one model per channel of each head, no prediction.
        residuals: `H(residual | channel)` after token-to-token prediction.
        metadata: Zero points and scales (fp16), per value.
        best_bits_per_value: `min(codes, residuals) + metadata`, per tensor, averaged.
        kv_bytes_ratio: `16 / best_bits_per_value`: the most an order-0 per-channel coder reaches.
    """

    bits: int
    codes: float
    residuals: float
    metadata: float
    best_bits_per_value: float
    kv_bytes_ratio: float


@dataclasses.dataclass(frozen=True)
class TaskFidelity:
    """Greedy decoding from a prefix restored at one bit width against full-KV decoding.

    Attributes:
        bits: Code width.
        resolution: The store resolution that restored the prefix.
        num_prompts: Prompts decoded.
        identical: Share of prompts whose output equals full-KV output token for token.
        matched_prefix: Mean share of each output's leading tokens that equal the full-KV output.
        reused_tokens: Prefix tokens restored from the store, summed over prompts.
    """

    bits: int
    resolution: str
    num_prompts: int
    identical: float
    matched_prefix: float
    reused_tokens: int


@dataclasses.dataclass(frozen=True)
class RateFidelityReport:
    """All of `kvlab codec bench --rate-fidelity`."""

    rates: list[CodecBenchStats]
    bounds: list[EntropyBound]
    fidelity: list[TaskFidelity]
    tasks: list[str]


def entropy_bounds(keys: torch.Tensor, values: torch.Tensor, bits_list: Sequence[int] = RATE_BITS,
                   chunk_tokens: int = 256) -> list[EntropyBound]:
    """The per-channel entropy bound of each bit width on `keys` and `values` `[L, H_kv, T, D]`."""
    bounds = []
    for bits in bits_list:
        parts = [_tensor_entropy(tensor, kind, bits, chunk_tokens) for kind, tensor in
                 (("keys", keys), ("values", values))]
        codes, residuals, metadata = (float(np.mean([part[i] for part in parts])) for i in range(3))
        best = float(np.mean([min(part[0], part[1]) + part[2] for part in parts]))
        bounds.append(EntropyBound(bits, codes, residuals, metadata, best, 16 / best))
    return bounds


def _tensor_entropy(tensor: torch.Tensor, kind: str, bits: int, chunk_tokens: int) -> tuple[float, float, float]:
    tokens = as_tokens(tensor)
    codes, residuals, meta_values = [], [], 0
    for start in range(0, tokens.shape[1], chunk_tokens):
        quantized = quantize(tokens[:, start : start + chunk_tokens], bits, kv_axis(kind), GROUP_SIZE)  # type: ignore[arg-type]
        chunk_codes = to_numpy(quantized.codes)
        codes.append(chunk_codes)
        residuals.append(token_residuals(chunk_codes, bits))
        meta_values += 2 * quantized.zeros.numel()
    all_codes, all_residuals = np.concatenate(codes, axis=1), np.concatenate(residuals, axis=1)
    contexts = channel_contexts(all_codes.shape)
    return (entropy_bits(all_codes, contexts), entropy_bits(all_residuals, contexts),
            16 * meta_values / max(tokens.numel(), 1))


def task_fidelity(
    loaded: LoadedModel,
    task_specs: Sequence[tuple[str, dict[str, Any]]] = DEFAULT_TASKS,
    samples_per_task: int = 2,
    bits_list: Sequence[int] = RATE_BITS,
    max_new_tokens: int = 24,
    chunk_tokens: int = 256,
    on_progress: Callable[[str], None] | None = None,
) -> list[TaskFidelity]:
    """Decode each task prompt from a prefix restored at each bit width; compare with full KV."""
    prompts = []
    for name, params in task_specs:
        task = tasks.create(name, **params)
        prompts += [encode_sample(loaded, sample) for sample in task.load(loaded.tokenizer, samples_per_task).samples]
    resolutions = [RESOLUTION_OF_BITS[bits] for bits in bits_list]
    config = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    store = create_store("memory://")
    # The reference may reuse earlier prompts' chunks only bit-exactly (restoring them equals recomputing).
    writer = PrefixCache.for_model(loaded, store, PrefixConfig(chunk_tokens, write=("exact", *resolutions),
                                                               fetch=("exact",)))
    identical = {bits: 0 for bits in bits_list}
    matched = {bits: 0.0 for bits in bits_list}
    reused = {bits: 0 for bits in bits_list}
    for prompt in prompts:
        reference = generate(loaded, [prompt], config, prefix=writer).requests[0].token_ids
        writer.flush()
        for bits, resolution in zip(bits_list, resolutions, strict=True):
            reader = PrefixCache.for_model(loaded, store, PrefixConfig(chunk_tokens, write=(), fetch=(resolution,),
                                                                       allow_recompute=False))
            output = generate(loaded, [prompt], config, prefix=reader)
            tokens = output.requests[0].token_ids
            identical[bits] += tokens == reference
            matched[bits] += _matched(tokens, reference) / max(len(reference), 1)
            reused[bits] += output.stats.prefix_reused_tokens
        if on_progress is not None:
            on_progress("prompt")
    writer.close()
    count = max(len(prompts), 1)
    return [TaskFidelity(bits, resolution, len(prompts), identical[bits] / count, matched[bits] / count, reused[bits])
            for bits, resolution in zip(bits_list, resolutions, strict=True)]


def rate_fidelity(
    loaded: LoadedModel,
    keys: torch.Tensor,
    values: torch.Tensor,
    task_specs: Sequence[tuple[str, dict[str, Any]]] = DEFAULT_TASKS,
    samples_per_task: int = 2,
    bits_list: Sequence[int] = RATE_BITS,
    on_progress: Callable[[str], None] | None = None,
) -> RateFidelityReport:
    """Rates, entropy bounds and task fidelity (see the module docstring); `on_progress` after each step."""
    rates = bench_codecs(keys, values, rate_cases(bits_list), on_progress)
    bounds = entropy_bounds(keys, values, bits_list)
    fidelity = task_fidelity(loaded, task_specs, samples_per_task, bits_list, on_progress=on_progress) \
        if samples_per_task > 0 and task_specs else []
    return RateFidelityReport(rates, bounds, fidelity, [name for name, _ in task_specs])


def code_bits(stats: CodecBenchStats) -> int:
    """The code width a rate row was measured at."""
    return int(stats.params["bits"])


def _matched(tokens: list[int], reference: list[int]) -> int:
    for index, (token, expected) in enumerate(zip(tokens, reference, strict=False)):
        if token != expected:
            return index
    return min(len(tokens), len(reference))
