"""Load on `kvlab serve` through the openai client: throughput and latency of plain vs lossless decoding,
and time to first token with and without a prefix store, measured in one run.

Usage: .venv/bin/python benchmarks/serve_load.py [--concurrency 1 2 4 8] [--prompt-tokens 2048 8064]
           [--new-tokens 64] [--drafter snapkv] [--shared-prefix-tokens 6144] [--shared-clients 8]
           [--device cpu] [--json PATH] [--quick]

Load matrix: a server (no store) is driven at each concurrency with streamed completions of each
prompt length; every client sends one request with its own prompt (a distinct first line, then the
bundled document) and `ignore_eos`, so every request generates exactly `--new-tokens`. Plain and
lossless requests go to the same server, one after the other per cell, and their texts are compared
(greedy: they must be identical). Per cell: output tokens/s over the cell's wall time, TTFT p50/p99
(send to first text), inter-token latency p50/p99 (gap between chunks over the tokens they carry).

Offline reference: `generate_lossless` at batch `--offline-batch` on the longest prompts, in this
process after the servers stopped; the ratio to the server's lossless throughput at that concurrency.

Shared prefix: `--shared-clients` clients at once, each `--shared-prefix-tokens` of the document plus
its own question, against a server without a store and against one with a memory:// prefix store
seeded by one earlier request. TTFT p50 with the store over without.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import openai

from kvlab.data import document_token_ids
from kvlab.models import load_model


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Server:
    """A `kvlab serve` subprocess on a free loopback port, stopped with SIGTERM by its own handle."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "kvlab.cli", "serve", "--port", str(self.port), *args]
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvlab serve exited: {log.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        else:
            self.stop()
            raise RuntimeError("kvlab serve did not start within 300 s")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=3600)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def one_request(client: openai.OpenAI, prompt: list[int], new_tokens: int, kvlab: dict[str, Any]) -> dict[str, Any]:
    """A streamed completion: its text, TTFT, per-token gaps and cached prompt tokens."""
    sent = time.perf_counter()
    stream = client.completions.create(
        model=client_model(client), prompt=prompt, max_tokens=new_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"kvlab": {**kvlab, "ignore_eos": True}},
    )
    text, first, last, count, gaps, cached = [], None, None, 0, [], 0
    for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
        if not chunk.choices or not chunk.choices[0].text:
            continue
        extra = chunk.model_extra or {}
        total = int(extra.get("kvlab", {}).get("completion_tokens", count + 1))
        if first is None:
            first = now
        elif last is not None:
            gaps.extend([(now - last) / max(total - count, 1)] * max(total - count, 1))
        last, count = now, total
        text.append(chunk.choices[0].text)
    assert first is not None and last is not None, "no text came back"
    return {
        "text": "".join(text),
        "ttft_s": first - sent,
        "gaps_s": gaps,
        "end_s": last,
        "tokens": count,
        "cached": cached,
    }


_MODELS: dict[int, str] = {}


def client_model(client: openai.OpenAI) -> str:
    if id(client) not in _MODELS:
        _MODELS[id(client)] = client.models.list().data[0].id
    return _MODELS[id(client)]


def run_clients(
    client: openai.OpenAI, prompts: list[list[int]], new_tokens: int, kvlab: dict[str, Any]
) -> dict[str, Any]:
    """All prompts at once, one client thread each; throughput over the wall time of the whole cell."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(lambda prompt: one_request(client, prompt, new_tokens, kvlab), prompts))
    wall = max(result["end_s"] for result in results) - start
    ttfts = [result["ttft_s"] for result in results]
    gaps = [gap for result in results for gap in result["gaps_s"]] or [0.0]
    return {
        "tokens_per_s": sum(result["tokens"] for result in results) / wall,
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p99_s": float(np.percentile(ttfts, 99)),
        "itl_p50_s": float(np.percentile(gaps, 50)),
        "itl_p99_s": float(np.percentile(gaps, 99)),
        "cached_tokens": [result["cached"] for result in results],
        "texts": [result["text"] for result in results],
    }


def prompts_for(tokenizer: Any, count: int, length: int, document: list[int]) -> list[list[int]]:
    """Distinct prompts of `length` tokens: a numbered first line, then the document."""
    prompts = []
    for index in range(count):
        head = list(tokenizer(f"Reader {index} asks about this text.\n", add_special_tokens=False)["input_ids"])
        prompts.append(head + document[: length - len(head)])
    return prompts


def offline_lossless(args: argparse.Namespace, prompts: list[list[int]]) -> float:
    """Output tokens/s of the offline engine on `prompts` as one batch (prefill included, as the server's)."""
    from kvlab.compress import compressors
    from kvlab.engine import generate_lossless
    from kvlab.generation import GenerationConfig
    from kvlab.lossless import LosslessConfig

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    drafter = compressors.create_from_strings(args.drafter, args.drafter_arg)
    config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    generate_lossless(loaded, [prompts[0][:64]], GenerationConfig(max_new_tokens=4), LosslessConfig(drafter))  # warm-up
    start = time.perf_counter()
    output = generate_lossless(loaded, prompts, config, LosslessConfig(drafter))
    return output.stats.new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    # 8064 prompt tokens and 64 new ones fit SmolLM2's 8192-token context (the server refuses more).
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[2048, 8064])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--drafter", default="snapkv")
    parser.add_argument("--drafter-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--shared-prefix-tokens", type=int, default=6144)
    parser.add_argument("--shared-clients", type=int, default=8)
    parser.add_argument("--shared-new-tokens", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=256, help="prefix store chunk (and prefill piece) size")
    parser.add_argument("--offline-batch", type=int, default=4)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure to PATH")
    parser.add_argument("--quick", action="store_true", help="small sizes that validate the script in about a minute")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.prompt_tokens, args.new_tokens = [1, 2], [256, 512], 8
        args.shared_prefix_tokens, args.shared_clients, args.shared_new_tokens, args.chunk_tokens = 512, 4, 4, 128
        args.offline_batch = 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    longest = max(max(args.prompt_tokens), args.shared_prefix_tokens + 64)
    document = document_token_ids(loaded.tokenizer, longest)
    common = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--max-num-seqs",
        str(max(max(args.concurrency), args.shared_clients)),
        "--max-tokens-limit",
        str(max(args.new_tokens, args.shared_new_tokens)),
        "--prefill-chunk-tokens",
        str(args.chunk_tokens),
        "--drafter",
        args.drafter,
        *[f"--drafter-arg={a}" for a in args.drafter_arg],
    ]
    if args.model:
        common += ["--model", args.model]
    workdir = Path(os.environ.get("TMPDIR", "/tmp"))
    tokenizer = loaded.tokenizer
    del loaded  # the servers load their own copy

    results: dict[str, Any] = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "load": [],
        "shared_prefix": {},
    }
    server = Server(common, workdir / "serve_load_plain.log")
    try:
        run_clients(server.client, prompts_for(tokenizer, 1, 64, document), 4, {"mode": "lossless"})  # warm-up
        for length in args.prompt_tokens:
            for concurrency in args.concurrency:
                prompts = prompts_for(tokenizer, concurrency, length, document)
                cell = {
                    mode: run_clients(server.client, prompts, args.new_tokens, {"mode": mode})
                    for mode in ("plain", "lossless")
                }
                identical = cell["plain"].pop("texts") == cell["lossless"].pop("texts")
                results["load"].append(
                    {"prompt_tokens": length, "concurrency": concurrency, "identical": identical, **cell}
                )
                report_cell(length, concurrency, cell, identical)
        shared = [
            document[: args.shared_prefix_tokens]
            + list(tokenizer(f"\nQuestion {i}: what happens next?", add_special_tokens=False)["input_ids"])
            for i in range(args.shared_clients)
        ]
        results["shared_prefix"]["no_store"] = run_clients(
            server.client, shared, args.shared_new_tokens, {"mode": "plain"}
        )
    finally:
        server.stop()

    stored = Server([*common, "--prefix-store", "memory://", "--prefix-chunk-tokens", str(args.chunk_tokens)],
                    workdir / "serve_load_store.log")
    try:
        seed = document[: args.shared_prefix_tokens] + list(
            tokenizer("\nSeed question.", add_special_tokens=False)["input_ids"]
        )
        deadline = time.monotonic() + 120
        while not one_request(stored.client, seed, 1, {"mode": "plain"})["cached"] and time.monotonic() < deadline:
            time.sleep(0.5)  # the first request's chunks are written in the background
        results["shared_prefix"]["store"] = run_clients(
            stored.client, shared, args.shared_new_tokens, {"mode": "plain"}
        )
    finally:
        stored.stop()
    report_shared(results["shared_prefix"], args)

    reference = [cell for cell in results["load"] if cell["prompt_tokens"] == max(args.prompt_tokens)
                 and cell["concurrency"] == args.offline_batch]
    if reference:
        offline = offline_lossless(args, prompts_for(tokenizer, args.offline_batch, max(args.prompt_tokens), document))
        server_tps = reference[0]["lossless"]["tokens_per_s"]
        results["offline_lossless"] = {
            "batch": args.offline_batch,
            "tokens_per_s": offline,
            "server_over_offline": server_tps / offline,
        }
        print(f"\nlossless, {max(args.prompt_tokens)}-token prompts: server at concurrency {args.offline_batch} "
              f"{server_tps:.1f} tok/s, offline engine at batch {args.offline_batch} {offline:.1f} tok/s "
              f"(server / offline {server_tps / offline:.2f}x)")
    if args.json:
        for part in results["shared_prefix"].values():
            part.pop("texts", None)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


def report_cell(length: int, concurrency: int, cell: dict[str, dict[str, Any]], identical: bool) -> None:
    if length and concurrency == 1 and not getattr(report_cell, "header", False):
        print(
            f"{'prompt':>7} {'conc':>4} {'mode':>8} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} "
            f"{'ITL p50':>8} {'p99':>7}  identical"
        )
        report_cell.header = True  # type: ignore[attr-defined]
    for mode, row in cell.items():
        print(f"{length:>7} {concurrency:>4} {mode:>8} {row['tokens_per_s']:>7.1f} {row['ttft_p50_s']:>8.2f}s "
              f"{row['ttft_p99_s']:>6.2f}s {row['itl_p50_s'] * 1000:>6.0f}ms {row['itl_p99_s'] * 1000:>5.0f}ms  "
              f"{'yes' if identical else 'NO'}")
    ratio = cell["lossless"]["tokens_per_s"] / cell["plain"]["tokens_per_s"]
    print(f"{'':>7} {'':>4} lossless / plain throughput {ratio:.2f}x")


def report_shared(shared: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    without, with_store = shared["no_store"], shared["store"]
    print(f"\nshared {args.shared_prefix_tokens}-token prefix, {args.shared_clients} clients at once:")
    for name, row in (("no store", without), ("prefix store", with_store)):
        print(f"  {name:>12}: TTFT p50 {row['ttft_p50_s']:.2f} s, p99 {row['ttft_p99_s']:.2f} s, "
              f"cached tokens per request {sorted(set(row['cached_tokens']))}")
    print(f"  TTFT p50 with the store / without: {with_store['ttft_p50_s'] / without['ttft_p50_s']:.2f}x")
    if without.get("texts") and with_store.get("texts"):
        print(f"  texts identical: {'yes' if without['texts'] == with_store['texts'] else 'NO'}")


if __name__ == "__main__":
    main()
