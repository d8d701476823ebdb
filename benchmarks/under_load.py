"""Decode speed when other processes compete for the cores, per OpenMP wait policy, measured in one run.

Usage: .venv/bin/python benchmarks/under_load.py [--context 2048] [--new-tokens 32] [--competitors 0 1 2]

Each cell runs plain and lossless decoding in a fresh subprocess (the wait policy is read when the
OpenMP runtime starts, so it cannot change inside one process) with `torch.get_num_threads()`
threads, while N competing processes spin on the cores. With C cores and N competitors, a fair share
is C / (C + N) of the cores; the table reports tokens/s relative to the same policy with no
competitor, next to that share. kvlab's CLI sets OMP_WAIT_POLICY=PASSIVE unless the environment
says otherwise (`kvlab.threads`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

CHILD = r"""
import json, sys, torch
from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.generation import GenerationConfig
from kvlab.engine import generate
from kvlab.lossless import LosslessConfig
from kvlab.engine import generate_lossless
from kvlab.models import load_model
context, new_tokens = int(sys.argv[1]), int(sys.argv[2])
loaded = load_model()
prompt = document_token_ids(loaded.tokenizer, context)
config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
generate(loaded, [prompt[:64]], GenerationConfig(max_new_tokens=4))
plain = generate(loaded, [prompt], config).stats.decode_tokens_per_s
drafter = create_compressor("snapkv", compression_ratio=0.9)
lossless = generate_lossless(loaded, [prompt], config, LosslessConfig(drafter)).stats.decode_tokens_per_s
print(json.dumps({"plain": plain, "lossless": lossless, "threads": torch.get_num_threads()}))
"""


def _spin(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def policy_environment(policy: str) -> dict[str, str]:
    """The environment of a policy: ACTIVE / PASSIVE, "default" (the runtime decides), or "SPIN:N"
    (libgomp spins N times at a barrier, then sleeps)."""
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy.startswith("SPIN:"):
        env["GOMP_SPINCOUNT"] = policy.partition(":")[2]
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    return env


def measure(policy: str, competitors: int, context: int, new_tokens: int) -> dict[str, float]:
    env = policy_environment(policy)
    spinners = [multiprocessing.Process(target=_spin, args=(time.time() + 3600,)) for _ in range(competitors)]
    for spinner in spinners:
        spinner.start()
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(context), str(new_tokens)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--competitors", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--policies", nargs="+", default=["ACTIVE", "default", "SPIN:10000", "PASSIVE"],
        help="ACTIVE, PASSIVE, default (unset), SPIN:N (GOMP_SPINCOUNT=N)",
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    results = {(p, n): measure(p, n, args.context, args.new_tokens) for p in args.policies for n in args.competitors}
    threads = next(iter(results.values()))["threads"]
    print(
        f"embedded SmolLM2-135M, fp32, context {args.context}, {args.new_tokens} new tokens, "
        f"{cores} cores, {threads} threads"
    )
    print("| wait policy | competitors | fair share | plain tok/s | vs alone | lossless tok/s | vs alone |")
    print("|---|---|---|---|---|---|---|")
    for (policy, competitors), row in results.items():
        alone = results[(policy, args.competitors[0])]
        share = cores / (cores + competitors)
        print(
            f"| {policy} | {competitors} | {share:.2f} | {row['plain']:.1f} | {row['plain'] / alone['plain']:.2f} | "
            f"{row['lossless']:.1f} | {row['lossless'] / alone['lossless']:.2f} |"
        )


if __name__ == "__main__":
    main()
