"""kvlab inside vLLM: TTFT of a restored shared prefix, bytes stored per token, and decode speed of
speculative decoding with kvlab's compressed-cache drafter against vLLM's own proposers.

Usage: .venv-vllm/bin/python benchmarks/vllm_integration.py [--prefix-tokens 4096] [--new-tokens 64]
           [--chunk-tokens 256] [--num-speculative-tokens 4] [--drafter '{"name": "snapkv", "budget": 512}']
           [--batch 1] [--prompt doc|summary-6k] [--draft-weights same|bf16|int8|int4] [--rows ...] [--compile]
           [--json PATH]

Every row runs its engines in fresh processes (vLLM keeps one KV connector per process), on the same
prompt: the embedded model's document, `--prefix-tokens` long, greedy. Rows:
  vllm cold                 a fresh engine computes the prompt (after a short unrelated warm-up request)
  vllm prefix cache         the same engine serves the prompt a second time from its in-memory prefix cache
  vllm + ExampleConnector   one engine saves the prompt's KV with vLLM's ExampleConnector (files), a
                            fresh engine restores it
  kvlab file:// exact       the same with KVLabConnector over a file:// store, bit-exact codec
  kvlab redis:// exact      ... over a loopback redis-server the benchmark starts (only when a redis://
                            row runs; `scripts/ensure-redis-server` installs it)
  kvlab redis:// adaptive   ... exact, int8 and int4 stored, kvlab's per-chunk planner picks
  decode: vllm plain / ngram / draft_model (the same SmolLM2 drafting) / kvlab proposer (compressed
  cache drafting, `--drafter`, from token ids alone) / kvlab proposer + hand-over (the same with
  KVLabConnector, no store, handing vLLM's KV to the proposer): tokens/s after the first token,
  measured within the requests themselves (vLLM's own first- and last-token timestamps), and vLLM's
  acceptance counters. `--batch N` sends N requests at once (the document from N offsets); their
  decode rate is every token after each first token over the span from the first first token to
  the last token, and the TTFT column is the wall time until the first first token. A speculating row
  may propose up to its own number of tokens ("decode: ngram k=8"); ratios over ngram are over its
  fastest row.
`ttft_s` is the wall time of a one-token request; `identical` compares the `--new-tokens` greedy tokens
with the cold engine's; `bytes_per_token` is what the connector stored divided by the tokens it
covers. The kvlab proposer row adds where its time goes (its own prefill, catch-up, drafting).
Timings are only comparable within one run on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONNECTOR_ROWS = ["vllm cold", "vllm prefix cache", "vllm + ExampleConnector", "kvlab file:// exact",
                  "kvlab redis:// exact", "kvlab redis:// adaptive"]
DECODE_ROWS = ["decode: vllm plain", "decode: ngram", "decode: draft_model", "decode: kvlab proposer",
               "decode: kvlab proposer + hand-over"]
# A decode row's speculator may propose up to its own number of tokens: "decode: ngram k=8".
ROW_TOKENS = " k="
# Tokens between the starts of the prompts of a batch (the bundled document read from several offsets).
BATCH_OFFSET = 256
ADAPTIVE = ("exact", "int8", "int4")
GET_REDIS_SERVER = "run scripts/ensure-redis-server (or apt-get install redis-server)"


def engine(args: argparse.Namespace, **options: Any) -> Any:
    from kvlab.integrations.vllm.model import model_directory

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib(model_directory(), args)))
    from vllm import LLM

    options.setdefault("enable_prefix_caching", False)
    return LLM(model=model_directory(), dtype="float32", max_model_len=args.prefix_tokens + args.new_tokens + 64,
               enforce_eager=not args.compile, max_num_seqs=args.batch, seed=0, disable_log_stats=False, **options)


def kv_cache_gib(model_dir: str, args: argparse.Namespace) -> int:
    """GiB of vLLM's CPU KV cache for a whole batch at once (2 at least): a cache that holds fewer rows makes
    vLLM preempt or hold back requests, and a batch row would then time fewer rows than it names."""
    from transformers import AutoConfig

    from kvlab.models.architecture import ModelArchitecture

    bytes_per_token = ModelArchitecture.from_config(AutoConfig.from_pretrained(model_dir)).kv_bytes_per_token(4)
    need = args.batch * (args.prefix_tokens + args.new_tokens + 64) * bytes_per_token * 1.25  # float32
    return max(2, math.ceil(need / 2**30))


def run(llm: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens of one request and its wall time."""
    tokens, total_s, _, _ = run_batch(llm, [prompt], max_tokens)
    return tokens[0], total_s


def run_batch(llm: Any, prompts: list[list[int]],
              max_tokens: int) -> tuple[list[list[int]], float, float | None, float]:
    """Greedy tokens of requests sent at once, their wall time, their decode span (from the first first
    token to the last token, as vLLM's engine stamped them; None without request metrics) and the spread
    of their first tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    total_s = time.perf_counter() - started
    stamps = [(getattr(o.metrics, "first_token_ts", 0.0), getattr(o.metrics, "last_token_ts", 0.0))
              for o in outputs if getattr(o, "metrics", None) is not None]
    first, last = min((f for f, _ in stamps), default=0.0), max((t for _, t in stamps), default=0.0)
    decode_s = last - first if len(stamps) == len(outputs) and first and last > first else None
    return [list(o.outputs[0].token_ids) for o in outputs], total_s, decode_s, first_token_spread_s(stamps)


def first_token_spread_s(stamps: list[tuple[float, float]]) -> float:
    """Seconds between the batch's first and last first tokens (0: every row decoded from the start)."""
    firsts = [first for first, _ in stamps if first]
    return max(firsts) - min(firsts) if firsts else 0.0


def warm_up(llm: Any) -> None:
    run(llm, list(range(100, 164)), 2)


def connector_options(args: argparse.Namespace, row: str, where: str) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    if row == "vllm + ExampleConnector":
        return {"kv_transfer_config": KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                                       kv_connector_extra_config={"shared_storage_path": where})}
    extra: dict[str, Any] = {"store": where, "chunk_tokens": args.chunk_tokens}
    extra.update(
        {"write": list(ADAPTIVE), "fetch": list(ADAPTIVE)} if "adaptive" in row else {"allow_recompute": False}
    )
    return {"kv_transfer_config": KVTransferConfig(kv_connector="KVLabConnector", kv_role="kv_both",
                                                   kv_connector_module_path="kvlab.integrations.vllm",
                                                   kv_connector_extra_config=extra)}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One engine's part of a row, in this (fresh) process."""
    prompts: list[list[int]] = json.loads(Path(args.prompt_file).read_text())
    prompt = prompts[0]
    row, phase = args.child, args.phase
    if row.startswith("decode:"):
        return decode_child(args, prompts)
    options: dict[str, Any] = {}
    if row == "vllm prefix cache":
        options["enable_prefix_caching"] = True
    elif row != "vllm cold":
        options = connector_options(args, row, args.where)
    llm = engine(args, **options)
    warm_up(llm)
    if phase == "save" or row == "vllm prefix cache":
        run(llm, prompt, 1)
        if phase == "save":
            shutdown(llm)
            return {}
    _, ttft_s = run(llm, prompt, 1)
    tokens, _ = run(llm, prompt, args.new_tokens)
    shutdown(llm)
    return {"ttft_s": ttft_s, "tokens": tokens}


def decode_child(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from kvlab.integrations.vllm.model import model_directory

    prompt = prompts[0]
    setting, k = row_tokens(args.child, args.num_speculative_tokens)
    kind = setting.removeprefix("decode: ")
    # The whole batch prefills in one step, so the decode span times the batch decoding together. With
    # vLLM's CPU default (4096 tokens a step) the prompts prefilled in chunks between the first requests'
    # decode steps: at batch 8 the span was mostly the other prompts' prefill.
    options: dict[str, Any] = {"max_num_batched_tokens": max(4096, sum(len(p) for p in prompts) + 64)}
    if kind == "ngram":
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
                                         "prompt_lookup_min": 2}
    elif kind == "draft_model":
        options["speculative_config"] = {
            "method": "draft_model",
            "model": model_directory(),
            "num_speculative_tokens": k,
        }
    elif kind.startswith("kvlab proposer"):
        os.environ["KVLAB_VLLM_DRAFTER"] = args.drafter
        os.environ["KVLAB_VLLM_DRAFT_WEIGHTS"] = args.draft_weights
        options["speculative_config"] = {"method": "custom_class", "num_speculative_tokens": k,
                                         "model": "kvlab.integrations.vllm.KVLabDraftProposer"}
        if kind.endswith("hand-over"):
            from vllm.config import KVTransferConfig

            options["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KVLabConnector", kv_role="kv_both", kv_connector_module_path="kvlab.integrations.vllm",
                kv_connector_extra_config={})
    llm = engine(args, **options)
    warm_up(llm)
    _, ttft_s = run(llm, prompt, 1)
    proposer = _proposer(llm)
    before = _counters(llm)
    if proposer is not None:
        # Count the measured requests only, and start them without the draft caches of the TTFT request
        # (the token-only path would find its sequence again by prefix and skip its own prefill).
        proposer.stats = type(proposer.stats)()
        proposer.by_prefix.clear()
        proposer.by_request.clear()
    tokens, total_s, decode_s, spread_s = run_batch(llm, prompts, args.new_tokens)
    after = _counters(llm)
    if decode_s is None:
        raise RuntimeError("vLLM kept no first/last token times for the request (run with disable_log_stats=False)")
    # Decode time within the measured requests themselves, first token to last: never their total minus a
    # TTFT taken in another request (a faster second prefill would shrink the decode time).
    result: dict[str, Any] = {"ttft_s": ttft_s, "tokens": tokens, "decode_s": decode_s,
                              "request_ttft_s": total_s - decode_s,
                              "decode_tokens_per_s": sum(len(t) - 1 for t in tokens) / decode_s,
                              "first_token_spread_s": spread_s, "num_speculative_tokens": k}
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    if drafted:
        result.update(acceptance_rate=accepted / drafted, acceptance_length=1 + accepted / max(drafts, 1))
    if proposer is not None:
        fit = proposer.costs.forwards.fit
        result["proposer"] = {**dataclasses.asdict(proposer.stats), "request_wall_s": total_s,
                              "lookup_acceptance": {str(ngram): round(acceptance.pooled()[0], 3) for ngram, acceptance
                                                    in sorted(proposer.lookup_acceptance.by_ngram.items())},
                              "cost_model": {"coefficients": proposer.costs.forwards.coefficients(),
                                             "mean_relative_error": fit.mean_relative_error,
                                             "num_ticks": fit.num_ticks}}
    shutdown(llm)
    return result


def batch_prompts(args: argparse.Namespace) -> list[list[int]]:
    """`--batch` prompts (the first is the one-request rows' prompt), their texts BATCH_OFFSET tokens apart:
    `doc`, the bundled document's, `--prefix-tokens` each; `summary-6k`, peers.py's long summary prompt."""
    from transformers import AutoTokenizer

    from kvlab.data import document_token_ids
    from kvlab.integrations.vllm.model import model_directory

    tokenizer = AutoTokenizer.from_pretrained(model_directory())
    if args.prompt == "summary-6k":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from peers import long_summary_prompt_ids

        return [long_summary_prompt_ids(tokenizer, i * BATCH_OFFSET) for i in range(args.batch)]
    document = document_token_ids(tokenizer, args.prefix_tokens + (args.batch - 1) * BATCH_OFFSET)
    return [document[i * BATCH_OFFSET:i * BATCH_OFFSET + args.prefix_tokens] for i in range(args.batch)]


def _proposer(llm: Any) -> Any:
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    drafter = getattr(runner, "drafter", None)
    return drafter if hasattr(drafter, "stats") else None


def _counters(llm: Any) -> dict[str, float]:
    prefix = "vllm:spec_decode_"
    return {metric.name.removeprefix(prefix): float(metric.value) for metric in llm.get_metrics()
            if metric.name.startswith(prefix) and hasattr(metric, "value")}


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def row_tokens(row: str, default: int) -> tuple[str, int]:
    """A row's setting without its own speculative tokens, and those (`default` where it names none)."""
    setting, _, tokens = row.partition(ROW_TOKENS)
    return setting, int(tokens) if tokens else default


def row_setting(row: str) -> str:
    """`row` checked: a known setting, where a decode row that speculates may name its own `k=N`."""
    setting, k = row_tokens(row, 1)
    if setting not in CONNECTOR_ROWS + DECODE_ROWS or (setting != row and (
            not setting.startswith("decode:") or setting == "decode: vllm plain" or k < 1)):
        raise argparse.ArgumentTypeError(f"unknown row {row!r}: one of {CONNECTOR_ROWS + DECODE_ROWS}, a speculating "
                                         "decode row with ' k=N' after it")
    return row


# ----- the parent: one child process per engine


def spawn(args: argparse.Namespace, row: str, phase: str, where: str = "") -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", row, "--phase", phase, "--where", where,
               "--prompt-file", args.prompt_file, "--prefix-tokens", str(args.prefix_tokens),
               "--new-tokens", str(args.new_tokens), "--chunk-tokens", str(args.chunk_tokens),
               "--num-speculative-tokens", str(args.num_speculative_tokens), "--drafter", args.drafter,
               "--batch", str(args.batch), "--draft-weights", args.draft_weights]
    if args.compile:
        command.append("--compile")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{row} ({phase}) failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _example_folder(where: str) -> Path:
    """ExampleConnector's folder (one per prompt) holding the most bytes: the measured prompt's."""
    return max((path for path in Path(where).iterdir() if path.is_dir()),
               key=lambda folder: sum(f.stat().st_size for f in folder.glob("*.safetensors")))


def stored_bytes(row: str, where: str) -> int:
    if row == "vllm + ExampleConnector":
        return sum(path.stat().st_size for path in _example_folder(where).glob("*.safetensors"))
    from kvlab.store import create_store

    store = create_store(where)
    try:
        listed = store.keys()
        return sum(store.nbytes(key) or 0 for key in listed)
    finally:
        store.close()


def stored_tokens(args: argparse.Namespace, row: str, where: str) -> int:
    if row == "vllm + ExampleConnector":
        from safetensors import safe_open

        # One file per layer, [tokens, ...]: ExampleConnector stores the prompt's block-aligned head.
        with safe_open(str(next(_example_folder(where).glob("*.safetensors"))), "pt") as file:
            return int(file.get_slice("kv_cache").get_shape()[0])
    # The prompt's complete chunks, the one holding its last token included (as `kvlab generate` saves).
    return args.prefix_tokens // args.chunk_tokens * args.chunk_tokens


def connector_row(args: argparse.Namespace, row: str, workdir: Path, redis_server: LoopbackRedis
                  ) -> dict[str, Any]:
    where = ""
    if row == "vllm + ExampleConnector":
        where = str(workdir / "example")
    elif row.startswith("kvlab file://"):
        where = f"file://{workdir / 'kvlab-store'}"
    elif needs_redis(row):
        where = redis_server.url()
        _flush(where)
    bytes_per_token = None
    if where:
        spawn(args, row, "save", where)
        bytes_per_token = stored_bytes(row, where) / stored_tokens(args, row, where)
    measured = spawn(args, row, "measure", where)
    return {"setting": row, "ttft_s": measured["ttft_s"], "decode_tokens_per_s": None,
            "bytes_per_token": bytes_per_token, "tokens": measured["tokens"]}


def _flush(url: str) -> None:
    import redis

    with redis.Redis.from_url(url) as client:
        client.flushdb()


def needs_redis(row: str) -> bool:
    """Whether `row` stores into a redis:// store, on the loopback redis-server the benchmark starts."""
    return row.startswith("kvlab redis://")


def missing_redis_server(rows: list[str]) -> str | None:
    """One line saying how to get redis-server when a row in `rows` needs it and it is not on PATH, else None."""
    needing = [row for row in rows if needs_redis(row)]
    if not needing or shutil.which("redis-server"):
        return None
    return (f"redis-server is not on PATH, and the rows {', '.join(repr(r) for r in needing)} start one: "
            f"{GET_REDIS_SERVER}, or leave those rows out of --rows")


class LoopbackRedis:
    """A redis-server on a free loopback port, started the first time a row asks for its URL."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._server: subprocess.Popen[bytes] | None = None
        self._url = ""

    def url(self) -> str:
        if self._server is None:
            self._server, self._url = start_redis(self.workdir)
        return self._url

    def stop(self) -> None:
        if self._server is not None:
            self._server.terminate()
            self._server.wait()
            self._server = None


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    import redis

    executable = shutil.which("redis-server")
    if executable is None:
        raise RuntimeError(f"redis-server is not on PATH: {GET_REDIS_SERVER}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                               "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            with redis.Redis.from_url(url) as client:
                client.ping()
            return server, url
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    server.terminate()
    raise RuntimeError("redis-server did not start (run scripts/ensure-redis-server)")


def parent(args: argparse.Namespace) -> list[dict[str, Any]]:
    workdir = Path(tempfile.mkdtemp(prefix="kvlab-vllm-bench-"))
    prompts = batch_prompts(args)
    args.prefix_tokens = max(len(p) for p in prompts)  # the engines' max_model_len; the connector's whole chunks
    args.prompt_file = str(workdir / "prompts.json")
    Path(args.prompt_file).write_text(json.dumps(prompts))
    redis_server = LoopbackRedis(workdir)  # started by the first redis:// row, if any
    rows: list[dict[str, Any]] = []
    try:
        for row in args.rows:
            print(f"running {row} ...", file=sys.stderr, flush=True)
            if row.startswith("decode:"):
                rows.append({"setting": row, "bytes_per_token": None, **spawn(args, row, "measure")})
            else:
                rows.append(connector_row(args, row, workdir, redis_server))
    finally:
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    # Connector rows are held to the cold engine's tokens, decode rows to vLLM plain decoding's.
    references = {kind: next((r["tokens"] for r in rows if r["setting"] == setting), None)
                  for kind, setting in (("connector", "vllm cold"), ("decode", "decode: vllm plain"))}
    for row in rows:
        reference = references["decode" if row["setting"].startswith("decode:") else "connector"]
        tokens = row.pop("tokens")
        row["identical"] = None if reference is None else tokens == reference
    add_decode_ratios(rows, args.prompt, args.batch)
    return rows


def add_decode_ratios(rows: list[dict[str, Any]], prompt: str, batch: int) -> None:
    """Each decode row's prompt, batch, and its decode rate and in-request TTFT over vLLM plain's and ngram's
    (of the same run; where ngram ran at several `k`, its fastest row), kept in the row itself."""
    def base(setting: str) -> dict[str, Any] | None:
        same = [r for r in rows if row_tokens(r["setting"], 0)[0] == setting and r.get("decode_tokens_per_s")]
        return max(same, key=lambda r: r["decode_tokens_per_s"], default=None)

    bases = {"plain": base("decode: vllm plain"), "ngram": base("decode: ngram")}
    for row in rows:
        if not row["setting"].startswith("decode:"):
            continue
        row.update(prompt=prompt, batch=batch)
        for name, reference in bases.items():
            if reference is not None:
                row[f"decode_x_{name}"] = row["decode_tokens_per_s"] / reference["decode_tokens_per_s"]
                if row.get("request_ttft_s") and reference.get("request_ttft_s"):
                    row[f"request_ttft_x_{name}"] = row["request_ttft_s"] / reference["request_ttft_s"]


def print_table(rows: list[dict[str, Any]]) -> None:
    cold = next((r["ttft_s"] for r in rows if r["setting"] == "vllm cold"), None)
    example = next((r["bytes_per_token"] for r in rows if r["setting"] == "vllm + ExampleConnector"), None)
    plain = next((r["decode_tokens_per_s"] for r in rows if r["setting"] == "decode: vllm plain"), None)
    plain_ttft = next((r.get("request_ttft_s") for r in rows if r["setting"] == "decode: vllm plain"), None)
    print(
        "| setting | TTFT s | TTFT / cold | in-request TTFT s | / plain | bytes/token | bytes / Example "
        "| decode tok/s | / plain | acceptance | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def ratio(value: float | None, base: float | None) -> str:
            return f"{value / base:.2f}x" if value is not None and base else "-"

        bytes_text = f"{r['bytes_per_token']:.0f}" if r["bytes_per_token"] is not None else "-"
        decode = r["decode_tokens_per_s"]
        acceptance = f"{r['acceptance_rate']:.2f} (len {r['acceptance_length']:.2f})" if "acceptance_rate" in r else "-"
        in_request = r.get("request_ttft_s")
        print(
            f"| {r['setting']} | {r['ttft_s']:.2f} | {ratio(r['ttft_s'], cold)} | "
            f"{f'{in_request:.2f}' if in_request is not None else '-'} | {ratio(in_request, plain_ttft)} | "
            f"{bytes_text} | {ratio(r['bytes_per_token'], example)} | {f'{decode:.2f}' if decode else '-'} | "
            f"{ratio(decode, plain)} | {acceptance} | {r['identical']} |"
        )
    for r in rows:
        if "proposer" in r:
            p = r["proposer"]
            parts = p["handover_s"] + p["adopt_s"] + p["prefill_s"] + p["draft_s"]
            print(f"\n{r['setting']}, measured requests ({p['request_wall_s']:.2f} s wall): proposer "
                  f"{p['total_s']:.2f} s = page reads {p['handover_s']:.2f} + adopting prompts (window, compression, "
                  f"check) {p['adopt_s']:.2f} + its own prefill {p['prefill_s']:.2f} + drafting {p['draft_s']:.2f} "
                  f"+ bookkeeping {p['total_s'] - parts:.2f}; {p['num_adopted']} prompts adopted, "
                  f"{p['num_prefills']} prefilled, {p['num_handover_tokens']} tokens' KV from the pages, "
                  f"fallbacks {p['fallbacks'] or 'none'}; row steps drafted by prompt lookup "
                  f"{p['num_lookup_rounds']}, by the compressed cache {p['num_cache_rounds']}, by none "
                  f"{p['num_plain_rows']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--drafter", default='{"name": "snapkv", "budget": 512}', help="kvlab compressor, JSON")
    parser.add_argument("--rows", nargs="+", default=CONNECTOR_ROWS + DECODE_ROWS, type=row_setting,
                        help=f"rows to run, of {CONNECTOR_ROWS + DECODE_ROWS} (default: all; 'vllm cold' is the "
                             "reference of the others); a speculating decode row may propose its own number of "
                             "tokens: 'decode: ngram k=8'")
    parser.add_argument("--batch", type=int, default=1, help="decode rows: requests sent at once")
    parser.add_argument("--prompt", choices=["doc", "summary-6k"], default="doc",
                        help="doc: the bundled document, --prefix-tokens long; summary-6k: peers.py's long summary "
                             "prompt (6452 tokens; --prefix-tokens ignored)")
    parser.add_argument("--draft-weights", default="same", choices=["same", "bf16", "int8", "int4"],
                        help="kvlab proposer rows: the weights that draft (KVLAB_VLLM_DRAFT_WEIGHTS)")
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the model (default: eager)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="measure", help=argparse.SUPPRESS)
    parser.add_argument("--where", default="", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    missing = missing_redis_server(args.rows)
    if missing is not None:  # before minutes of other rows, not when the first redis:// row comes
        print(missing, file=sys.stderr)
        return 1
    rows = parent(args)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
