"""Prefix reuse over emulated links: time to first token of recompute vs fetching, measured in one run.

Usage: .venv/bin/python benchmarks/prefix_reuse.py [--prefix-tokens 8000] [--links 0.1 1 10]
           [--new-tokens 16] [--chunk-tokens 256] [--scheduler-link 0.1] [--json]

A first request (shared prefix + suffix A) computes the prefix and stores its chunks at every
resolution in a memory store; a second request (same prefix + suffix B) then reuses them through a
token-bucket link of each bandwidth. Rows per link:
  raw fetch         the fp32 bytes, no codec (the plain-transfer baseline)
  exact             bit-exact byte-plane codec (output identical)
  int8 / int4       code-lossless quantized codes, zstd (output may differ)
  int4/int2-video   code-lossless codes coded by lossless HEVC (KVCodec), restored token by token
  adaptive          per chunk any resolution or recompute, planned from measured bandwidth
  adaptive-exact    raw, exact or recompute only (output identical)
  lossless int4     lossless decoding drafting from an int4 window of the prefix while the exact
  lossless int2-video  prefix arrives (from the zstd or the video-coded copy)
TTFT ratios are against recomputing the whole prompt and against the raw fetch on the same link;
"identical" compares the first `--new-tokens` greedy tokens with recompute and "fidelity" is the
share of them matched before the first difference (lossy rows). For token-by-token restores, "buffer"
is the peak decode buffer of one chunk (payload, frames, metadata) and "overlap" the mean share of a
chunk's decode during which its first tokens were already restored.

The scheduler part serves one reuse request over a slow link plus short requests that need no fetch,
arriving just after it, with and without the fetch-aware scheduler: mean TTFT of the short ones.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.engine import Engine, EngineCallbacks, EngineConfig, Request, SinglePrefixSource, generate, generate_lossless
from kvlab.generation import GenerationConfig, GenerationOutput
from kvlab.lossless import LosslessConfig, LosslessOutput
from kvlab.models import LoadedModel, load_model
from kvlab.store import KVStore, create_store
from kvlab.store.backends.link import ThrottledStore
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.resolution import RESOLUTIONS
from kvlab.timing import Stopwatch

# (label, fetch resolutions, allow recompute, lossless drafting resolution)
MODES: list[tuple[str, tuple[str, ...], bool, str | None]] = [
    ("raw fetch", ("raw",), False, None),
    ("exact", ("exact",), False, None),
    ("int8", ("int8",), False, None),
    ("int4", ("int4",), False, None),
    ("int4-video", ("int4-video",), False, None),
    ("int2-video", ("int2-video",), False, None),
    ("adaptive", tuple(RESOLUTIONS), True, None),
    ("adaptive-exact", ("raw", "exact"), True, None),
    ("lossless int4", ("exact", "int4"), False, "int4"),
    ("lossless int2-video", ("exact", "int2-video"), False, "int2-video"),
]


def reader(loaded: LoadedModel, store: KVStore, chunk_tokens: int, fetch: tuple[str, ...], recompute: bool,
           prefill_tokens_per_s: float) -> PrefixCache:
    """A read-only prefix cache that knows this machine's prefill speed (as a serving process would)."""
    config = PrefixConfig(
        chunk_tokens=chunk_tokens,
        write=(),
        fetch=fetch,
        allow_recompute=recompute,
        prior_prefill_tokens_per_s=prefill_tokens_per_s,
    )
    return PrefixCache.for_model(loaded, store, config)


def run_mode(loaded: LoadedModel, prompt: list[int], prefix: PrefixCache, new_tokens: int,
             lossless_from: str | None) -> GenerationOutput:
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    if lossless_from is None:
        return generate(loaded, [prompt], config, prefix=prefix)
    # The drafter already sees only a window of the prefix (its first and last chunks): it keeps all of it.
    lossless = LosslessConfig(create_compressor("snapkv", compression_ratio=0.0), "auto", prefix_draft=lossless_from)
    return generate_lossless(loaded, [prompt], config, lossless, prefix=prefix)


def serve_arrivals(
    loaded: LoadedModel, prefix: PrefixCache, arrivals: list[tuple[float, list[int]]], config: GenerationConfig,
    fetch_workers: int,
) -> tuple[list[float], list[list[int]]]:
    """Requests arriving at their times (seconds from now) into one engine: each one's time from arrival
    to first token, and its tokens. With `fetch_workers` a prefix is fetched in the background before
    admission (fetch-aware); with 0 it is fetched inline by the prefill, in arrival order."""
    first_token_s: dict[int, float] = {}
    clock = Stopwatch()
    engine = Engine(loaded, EngineConfig(interleave_prefill=True, fetch_workers=fetch_workers),
                    SinglePrefixSource(prefix),
                    EngineCallbacks(on_tokens=lambda i, _: first_token_s.setdefault(i, clock.elapsed())))
    ids: list[int] = []
    while len(ids) < len(arrivals) or engine.num_unfinished():
        while len(ids) < len(arrivals) and arrivals[len(ids)][0] <= clock.elapsed():
            ids.append(engine.add_request(Request(arrivals[len(ids)][1], config)))
        if engine.has_work():
            engine.step()
        else:
            time.sleep(0.005)
    engine.close()
    ttft = [first_token_s[request_id] - arrival for request_id, (arrival, _) in zip(ids, arrivals, strict=True)]
    return ttft, [engine.output(request_id).token_ids for request_id in ids]


def total_s(output: GenerationOutput) -> float:
    return output.stats.ttft_s + output.stats.decode_s


def matched_share(tokens: list[int], reference: list[int]) -> float:
    """Share of `reference` matched before the first differing token."""
    matched = next(
        (i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), min(len(tokens), len(reference))
    )
    return matched / max(len(reference), 1)


def restore_overlap(output: GenerationOutput) -> float | None:
    """Mean restore overlap of the chunks restored token by token (None: none was)."""
    chunks = sum(f.token_restored_chunks for f in output.stats.prefix_fetches)
    return sum(f.restore_overlap for f in output.stats.prefix_fetches) / chunks if chunks else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=8000)
    parser.add_argument("--suffix-tokens", type=int, default=48)
    parser.add_argument("--links", type=float, nargs="+", default=[0.1, 1.0, 10.0], help="Gbit/s")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--modes", nargs="*", help="labels to run (default: all)")
    parser.add_argument(
        "--scheduler-link", type=float, default=0.1, help="Gbit/s of the scheduler experiment (0: skip)"
    )
    parser.add_argument("--short-requests", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    loaded = load_model()
    document = document_token_ids(loaded.tokenizer, args.prefix_tokens + 2 * args.suffix_tokens)
    shared = document[: args.prefix_tokens]
    prompt_a = shared + document[args.prefix_tokens : args.prefix_tokens + args.suffix_tokens]
    prompt_b = shared + document[args.prefix_tokens + args.suffix_tokens :]
    config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    generate(loaded, [document[:64]], GenerationConfig(max_new_tokens=2))  # warm-up

    recompute = generate(loaded, [prompt_b], config)
    reference = recompute.requests[0].token_ids
    prefill_speed = len(prompt_b) / recompute.stats.ttft_s

    memory = create_store("memory://")
    writer = PrefixCache.for_model(
        loaded, memory, PrefixConfig(args.chunk_tokens, write=tuple(RESOLUTIONS), fetch=("exact",))
    )
    generate(loaded, [prompt_a], GenerationConfig(max_new_tokens=1), prefix=writer)
    writer.close()
    stored_bytes = {name: 0 for name in RESOLUTIONS}
    for name in RESOLUTIONS:
        for key in writer.keys(prompt_a, name):
            stored_bytes[name] += memory.nbytes(key) or 0

    rows: list[dict[str, Any]] = [
        {
            "link_gbit": None,
            "mode": "recompute",
            "ttft_s": recompute.stats.ttft_s,
            "total_s": total_s(recompute),
            "identical": True,
            "fidelity": 1.0,
            "peak_decode_buffer_bytes": 0,
            "restore_overlap": None,
            "fetched_bytes": 0,
            "resolutions": {},
        }
    ]
    for gbit in args.links:
        link = ThrottledStore(memory, bits_per_s=gbit * 1e9)
        for label, fetch, allow_recompute, lossless_from in MODES:
            if args.modes and label not in args.modes:
                continue
            prefix = reader(loaded, link, args.chunk_tokens, fetch, allow_recompute, prefill_speed)
            output = run_mode(loaded, prompt_b, prefix, args.new_tokens, lossless_from)
            resolutions: dict[str, int] = {}
            for fetch_stats in output.stats.prefix_fetches:
                for name, count in fetch_stats.resolutions.items():
                    resolutions[name] = resolutions.get(name, 0) + count
            rows.append({
                "link_gbit": gbit,
                "mode": label,
                "ttft_s": output.stats.ttft_s,
                "total_s": total_s(output),
                "identical": output.requests[0].token_ids == reference,
                "fidelity": matched_share(output.requests[0].token_ids, reference),
                "peak_decode_buffer_bytes": max((f.peak_decode_buffer_bytes for f in output.stats.prefix_fetches),
                                                default=0),
                "restore_overlap": restore_overlap(output),
                "fetched_bytes": sum(f.nbytes for f in output.stats.prefix_fetches),
                "resolutions": resolutions,
                "acceptance_length": output.lossless.acceptance_length if isinstance(output, LosslessOutput) else None,
            })

    scheduler_rows: list[dict[str, Any]] = []
    if args.scheduler_link > 0:
        link = ThrottledStore(memory, bits_per_s=args.scheduler_link * 1e9)
        shorts = [document[512 * (i + 1) : 512 * (i + 2)] for i in range(args.short_requests)]
        arrivals = [(0.0, prompt_b)] + [(0.2 * (i + 1), p) for i, p in enumerate(shorts)]
        for fetch_aware in (False, True):
            prefix = reader(loaded, link, args.chunk_tokens, ("exact",), False, prefill_speed)
            ttft, outputs = serve_arrivals(loaded, prefix, arrivals, config, fetch_workers=1 if fetch_aware else 0)
            scheduler_rows.append({
                "fetch_aware": fetch_aware,
                "short_mean_ttft_s": sum(ttft[1:]) / len(ttft[1:]),
                "reuse_ttft_s": ttft[0],
                "identical": all(
                    tokens == generate(loaded, [p], config).requests[0].token_ids
                    for tokens, (_, p) in zip(outputs[1:], arrivals[1:], strict=True)
                ) and outputs[0] == reference,
            })

    meta = {
        "prefix_tokens": len(shared), "prompt_tokens": len(prompt_b), "chunk_tokens": args.chunk_tokens,
        "threads": torch.get_num_threads(), "load_avg": os.getloadavg()[0], "stored_bytes": stored_bytes,
    }
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows, "scheduler": scheduler_rows}, indent=2))
        return
    print(
        f"embedded SmolLM2-135M, fp32, shared prefix {len(shared)} tokens, prompt {len(prompt_b)}, chunks of "
        f"{args.chunk_tokens}, {torch.get_num_threads()} threads, load avg {meta['load_avg']:.2f}"
    )
    sizes = ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in stored_bytes.items())
    print(f"stored prefix: {sizes}")
    print(
        f"| link | mode | TTFT s | vs recompute | vs raw fetch | time to {args.new_tokens} tokens s "
        "| fetched MiB | chunks | identical | fidelity | buffer MiB | overlap |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    raw_ttft = {row["link_gbit"]: row["ttft_s"] for row in rows if row["mode"] == "raw fetch"}
    for row in rows:
        link_label = "-" if row["link_gbit"] is None else f"{row['link_gbit']:g} Gbit/s"
        raw = raw_ttft.get(row["link_gbit"])
        vs_raw = f"{row['ttft_s'] / raw:.2f}x" if raw else "-"
        chunks = " ".join(f"{name}:{count}" for name, count in sorted(row["resolutions"].items())) or "-"
        buffer = f"{row['peak_decode_buffer_bytes'] / 2**20:.2f}" if row["peak_decode_buffer_bytes"] else "-"
        overlap = "-" if row["restore_overlap"] is None else f"{row['restore_overlap']:.0%}"
        print(
            f"| {link_label} | {row['mode']} | {row['ttft_s']:.2f} | {row['ttft_s'] / recompute.stats.ttft_s:.2f}x | "
            f"{vs_raw} | {row['total_s']:.2f} | {row['fetched_bytes'] / 2**20:.0f} | {chunks} | "
            f"{'yes' if row['identical'] else 'NO'} | {row['fidelity']:.0%} | {buffer} | {overlap} |"
        )
    if scheduler_rows:
        print(
            f"\nscheduler: 1 reuse request over {args.scheduler_link:g} Gbit/s + {args.short_requests} short requests"
        )
        print("| scheduler | mean TTFT of short requests s | TTFT of the reuse request s | identical |")
        print("|---|---|---|---|")
        for row in scheduler_rows:
            print(
                f"| {'fetch-aware' if row['fetch_aware'] else 'arrival order'} | {row['short_mean_ttft_s']:.2f} | "
                f"{row['reuse_ttft_s']:.2f} | {'yes' if row['identical'] else 'NO'} |"
            )


if __name__ == "__main__":
    main()
