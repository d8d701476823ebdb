"""Lossless decoding vs plain full-KV decoding vs lossy decoding, measured in one run, per full-KV tier.

Usage: .venv/bin/python benchmarks/lossless_decode.py [--contexts 2048 8064] [--new-tokens 128]
           [--batch 1] [--settings LABEL ...] [--full-kv-tier memory emulated:2 disk] [--json PATH]

For each context the prompts (different offsets of the bundled document) are prefilled once per
drafter; every setting then decodes from copies of those caches, so the table compares decoding
only. On each tier, plain decoding (kvlab's engine, as `kvlab generate` runs it) reads the full KV
from the tier every step; it runs first and again last, and the mean of its two rates is the
baseline of that tier's rows (so the plain row's own ratio shows how far the machine drifted). The
setting "plain full KV, reference loop" decodes through the loop whose logits equal transformers'
forward bit for bit.
Columns: decode tokens/s, speed-up over plain on the same tier, mean acceptance length (accepted
drafts + 1 per round), mean draft length, the bytes-bound ceiling, and whether the output is
identical to plain decoding.

The bytes-bound ceiling is plain's bytes read per emitted token over this setting's. In memory: a
plain step reads the linear layers' weights once and every row's full KV; a lossless round of one row
reads, per draft token, its share of the (draft) weights and its draft KV, then its share of the
weights and its full KV for the verify, and emits `acceptance length` tokens. On a slower tier the
link is what plain decoding waits for, so the ceiling is the ratio of the full-KV bytes each moved
over the link for the same tokens (measured by the tier).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from kvlab.attention_kernels import warm_up_split_kv
from kvlab.cache import KVCache
from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.engine import Engine, EngineConfig, PrefilledPrompt, Request
from kvlab.generation import GenerationConfig, GenerationOutput, reference_decode
from kvlab.generation.prefill import PrefillCaches, prefill
from kvlab.lossless import LosslessConfig, LosslessOutput
from kvlab.lossless.prompt_lookup import split_drafter_name
from kvlab.models import DEFAULT_MODEL, LoadedModel, load_model
from kvlab.models.draft_weights import draft_model
from kvlab.models.int4_linear import Int4Linear
from kvlab.models.packed_linear import PackedLinear

# (label, mode, compressor name, compressor params, num_draft_tokens, draft weights)
SETTINGS: list[tuple[str, str, str | None, dict[str, object], int | str, str]] = [
    ("plain full KV", "full", None, {}, 0, "same"),
    ("plain full KV, reference loop", "reference", None, {}, 0, "same"),
    ("lossy snapkv-0.9", "lossy", "snapkv", {"compression_ratio": 0.9}, 0, "same"),
    ("lossy kivi-2", "lossy", "kivi", {"bits": 2}, 0, "same"),
    ("lossless snapkv-0.9 k=auto", "lossless", "snapkv", {"compression_ratio": 0.9}, "auto", "same"),
    ("lossless ngram+snapkv-0.9 k=auto", "lossless", "ngram+snapkv", {"compression_ratio": 0.9}, "auto", "same"),
    ("lossless snapkv-0.9 k=8", "lossless", "snapkv", {"compression_ratio": 0.9}, 8, "same"),
    ("lossless snapkv-0.9 k=32", "lossless", "snapkv", {"compression_ratio": 0.9}, 32, "same"),
    ("lossless kivi-4 k=32", "lossless", "kivi", {"bits": 4}, 32, "same"),
    ("lossless snapkv-0.9 k=auto bf16 drafter", "lossless", "snapkv", {"compression_ratio": 0.9}, "auto", "bf16"),
    ("lossless snapkv-0.9 k=auto int8 drafter", "lossless", "snapkv", {"compression_ratio": 0.9}, "auto", "int8"),
    ("lossless snapkv-0.9 k=auto int4 drafter", "lossless", "snapkv", {"compression_ratio": 0.9}, "auto", "int4"),
    ("lossless ngram+snapkv-0.9 k=auto int4 drafter", "lossless", "ngram+snapkv", {"compression_ratio": 0.9}, "auto",
     "int4"),
    ("lossless kivi-4 k=auto int8 drafter", "lossless", "kivi", {"bits": 4}, "auto", "int8"),
    ("MagicDec-style streamingllm-0.9 k=3", "lossless", "streamingllm", {"compression_ratio": 0.9}, 3, "same"),
]
MAX_NUM_DRAFT_TOKENS = 64

Prefilled = list[tuple[KVCache, KVCache, torch.Tensor]]


def warm_up_decode_attention(loaded: LoadedModel) -> None:
    """Compile the split-KV decode attention before anything is timed (a CPU float32 model's first long
    cache would otherwise pay seconds of compiling inside the first row measured)."""
    architecture = loaded.architecture
    if loaded.device.type == "cpu" and loaded.dtype == torch.float32:
        warm_up_split_kv(architecture.num_kv_heads, architecture.num_kv_groups, architecture.head_dim)


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a forward reads: every linear layer's (int8 packed weights count 1 byte, int4
    layers their packed codes and their scales and zeros)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int4Linear):
            total += module.weight_nbytes()
        elif isinstance(module, PackedLinear):
            total += module.in_features * module.out_features * module.packed_weight.element_size()
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif hasattr(module, "weight") and callable(module.weight) and "Linear" in type(module).__name__:
            total += module.weight().numel()  # dynamic int8 linear: packed int8 weights
    return total


def attended_bytes(cache: KVCache) -> int:
    """Bytes a decode step's attention reads from a cache: every stored token's keys and values as held
    (a quantized layer's dequantized working copy included); a sliding-window layer reads its window."""
    total = 0
    for layer in cache.layers:
        keys = layer.keys  # type: ignore[attr-defined]
        window = layer.sliding_window
        tokens = sum(length if window is None else min(length, window) for length in layer.lengths)  # type: ignore[attr-defined]
        total += 2 * keys.shape[1] * tokens * keys.shape[3] * keys.element_size()
    return total


def prefill_all(loaded: LoadedModel, prompts: list[list[int]], name: str, params: dict[str, object]) -> Prefilled:
    capacity = max(len(p) for p in prompts) + 512 + MAX_NUM_DRAFT_TOKENS + 2
    drafter = create_compressor(split_drafter_name(name)[1], **params)
    result = []
    for prompt in prompts:
        full, draft, logits = prefill(loaded, [prompt], PrefillCaches(capacity, drafter=drafter))
        assert draft is not None
        result.append((full, draft, logits))
    return result


def run_setting(
    loaded: LoadedModel, prompts: list[list[int]], setting: tuple, prefilled: Prefilled, config: GenerationConfig  # type: ignore[type-arg]
) -> GenerationOutput:
    """Decode `prompts` from copies of their prefilled caches: through kvlab's engine (plain, lossy and
    lossless requests, all as a user runs them), or, for the reference row, through the decode loop
    that is token- and logit-identical to transformers' forward."""
    _, mode, name, params, num_draft_tokens, draft_weights = setting
    if mode == "reference":
        caches = [full.clone() for full, _, _ in prefilled]
        cache = caches[0] if len(caches) == 1 else KVCache.stack(caches, caches[0].layers[0].capacity)  # type: ignore[attr-defined]
        return reference_decode(loaded, prompts, cache, torch.cat([logits for _, _, logits in prefilled]), config)
    lossless, compressor = None, None
    if mode == "lossless":
        assert name is not None
        lookup, drafter = split_drafter_name(name)
        lossless = LosslessConfig(create_compressor(drafter, **params), num_draft_tokens, MAX_NUM_DRAFT_TOKENS,
                                  draft_weights=draft_weights, prompt_lookup=lookup)
    elif mode == "lossy":
        assert name is not None
        compressor = create_compressor(name, **params)
    engine = Engine(loaded, EngineConfig())
    ids = []
    for prompt, (full, draft, logits) in zip(prompts, prefilled, strict=True):
        request = Request(prompt, config, compressor=compressor, lossless=lossless)
        cache, draft_copy = (draft.clone(), None) if mode == "lossy" else (full.clone(), None)
        if lossless is not None:
            draft_copy = draft.clone()
        ids.append(engine.add_request(request, PrefilledPrompt(cache, draft_copy, logits)))
    while engine.num_unfinished():
        engine.step()
    stats, rounds = engine.finish_stats()
    outputs = [engine.output(request_id) for request_id in ids]
    return LosslessOutput(outputs, stats, rounds) if lossless is not None else GenerationOutput(outputs, stats)


def bytes_per_token(
    loaded: LoadedModel, setting: tuple, output: GenerationOutput, prefilled: Prefilled, batch: int  # type: ignore[type-arg]
) -> float:
    """Bytes read per emitted token, from the model's weights, the caches' stored tokens and the
    measured acceptance (see the module docstring)."""
    _, mode, _, _, _, draft_weights = setting
    weights = linear_weight_bytes(loaded.model)
    full_kv = sum(attended_bytes(full) for full, _, _ in prefilled) / batch
    draft_kv = sum(attended_bytes(draft) for _, draft, _ in prefilled) / batch
    if mode in ("full", "reference"):
        return weights / batch + full_kv
    if mode == "lossy":
        return weights / batch + draft_kv
    assert isinstance(output, LosslessOutput)
    stats = output.lossless
    drafter_weights = linear_weight_bytes(draft_model(loaded.model, draft_weights))
    per_round = stats.mean_num_draft_tokens * (drafter_weights / batch + draft_kv) + weights / batch + full_kv
    return per_round / stats.acceptance_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8064])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together (different offsets)")
    parser.add_argument("--settings", nargs="*", help="labels to run (plain full KV always runs)")
    parser.add_argument(
        "--full-kv-tier", nargs="+", default=["memory"], help="tiers: memory, host, disk, emulated:GBPS"
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias, .gguf file or model directory")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--compile-forward", action="store_true",
                        help="every forward through the graph compiled by torch.compile (load_model(compile_forward"
                             "=True)): plain and lossless alike")
    args = parser.parse_args()

    loaded = load_model(args.model, device=args.device, compile_forward=args.compile_forward)
    warm_up_decode_attention(loaded)  # compile before anything is timed
    warm = prefill_all(loaded, [document_token_ids(loaded.tokenizer, 128)], "snapkv", {"compression_ratio": 0.9})
    run_setting(
        loaded, [document_token_ids(loaded.tokenizer, 128)], SETTINGS[3], warm, GenerationConfig(max_new_tokens=8)
    )
    selected = [s for s in SETTINGS if not args.settings or s[0] in args.settings or s[1] == "full"]
    rows = []
    for context in args.contexts:
        document = document_token_ids(loaded.tokenizer, context + 64 * args.batch)
        prompts = [document[64 * row : 64 * row + context] for row in range(args.batch)]
        prefills: dict[str, Prefilled] = {}
        for setting in selected:
            key = json.dumps([setting[2] or "snapkv", setting[3] or {"compression_ratio": 0.9}], sort_keys=True)
            if key not in prefills:
                prefills[key] = prefill_all(
                    loaded, prompts, setting[2] or "snapkv", setting[3] or {"compression_ratio": 0.9}
                )
        for tier in args.full_kv_tier:
            config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True, full_kv_tier=tier)
            baseline = None
            tier_start = len(rows)
            first_key = json.dumps(["snapkv", {"compression_ratio": 0.9}], sort_keys=True)
            for setting in selected:
                if setting[1] == "lossy" and tier != "memory":
                    continue  # lossy decoding never reads the full KV
                key = json.dumps([setting[2] or "snapkv", setting[3] or {"compression_ratio": 0.9}], sort_keys=True)
                output = run_setting(loaded, prompts, setting, prefills[key], config)
                tokens = [request.token_ids for request in output.requests]
                cost = bytes_per_token(loaded, setting, output, prefills[key], args.batch)
                if baseline is None:
                    baseline = (output.stats.decode_tokens_per_s, tokens, cost, output.stats.tier_bytes_read)
                lossless = output.lossless if isinstance(output, LosslessOutput) else None
                rows.append(
                    {
                        "setting": setting[0],
                        "context": context,
                        "batch": args.batch,
                        "tier": tier,
                        "new_tokens": args.new_tokens,
                        "decode_tokens_per_s": output.stats.decode_tokens_per_s,
                        "speedup_vs_plain": output.stats.decode_tokens_per_s / baseline[0],
                        "identical": tokens == baseline[1],
                        "acceptance_length": lossless.acceptance_length if lossless else None,
                        "mean_num_draft_tokens": lossless.mean_num_draft_tokens if lossless else None,
                        "bytes_per_token": cost,
                        "bytes_bound_speedup": (
                            baseline[2] / cost
                            if tier == "memory"
                            else baseline[3] / max(output.stats.tier_bytes_read, 1)
                        ),
                        "tier_bytes_read": output.stats.tier_bytes_read,
                        "tier_wait_s": output.stats.tier_wait_s,
                        "draft_s": lossless.draft_s if lossless else None,
                        "verify_s": lossless.verify_s if lossless else None,
                        "rounds": lossless.rounds if lossless else None,
                        "num_plain_rounds": lossless.num_plain_rounds if lossless else None,
                        "num_plans": lossless.num_plans if lossless else None,
                        "cost_model_mre": lossless.cost_model_mre if lossless else None,
                    }
                )
            # Plain again, last: the machine drifts, so every row of this tier is set against the mean
            # of plain before and after it (both rates are kept in the JSON).
            again = run_setting(loaded, prompts, selected[0], prefills[first_key], config).stats.decode_tokens_per_s
            assert baseline is not None
            plain_rate = (baseline[0] + again) / 2
            for row in rows[tier_start:]:
                row["plain_tokens_per_s_before_after"] = [baseline[0], again]
                row["speedup_vs_plain"] = row["decode_tokens_per_s"] / plain_rate
            drift = f"plain {baseline[0]:.1f} before, {again:.1f} after"
            print(f"done: context {context}, tier {tier} ({drift})", flush=True)
    header = (
        f"{loaded.name}, fp32, {args.device}, batch {args.batch}, {args.new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, load avg {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        args.json.write_text(json.dumps({"header": header, "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print(header + "; vs plain: against the mean of plain decoding run first and last on each tier")
    print(
        "| context | tier | setting | decode tok/s | vs plain | acceptance length | mean draft length "
        "| bytes-bound ceiling | identical to plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        acceptance = f"{row['acceptance_length']:.1f}" if row["acceptance_length"] else "-"
        draft = f"{row['mean_num_draft_tokens']:.1f}" if row["mean_num_draft_tokens"] else "-"
        print(
            f"| {row['context']} | {row['tier']} | {row['setting']} | {row['decode_tokens_per_s']:.1f} | "
            f"{row['speedup_vs_plain']:.2f}x | {acceptance} | {draft} | {row['bytes_bound_speedup']:.2f}x | "
            f"{'yes' if row['identical'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
