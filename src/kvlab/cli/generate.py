"""`kvlab generate`: continue one prompt with the chosen model and print the answer and its stats."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kvlab.cli.base import EXIT_OK, Command, add_json_flag, print_json, read_prompt_file
from kvlab.cli.flags import add_config_flags, given_values
from kvlab.cli.progress import TextStream, TokenProgress
from kvlab.compress import Compressor, compressors
from kvlab.engine import generate, generate_lossless
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig, GenerationOutput
from kvlab.lossless import LosslessConfig, LosslessOutput
from kvlab.lossless.config import lossless_exact
from kvlab.lossless.prompt_lookup import split_drafter_name
from kvlab.models import DEFAULT_MODEL, DTYPES, LoadedModel, load_configured_model
from kvlab.store.prefix import PrefixCache, PrefixConfig

GENERATION_FIELDS = (
    "max_new_tokens", "temperature", "top_p", "seed", "stop_strings", "ignore_eos", "prefill_chunk_tokens",
    "full_kv_tier",
)
LOSSLESS_FIELDS = ("num_draft_tokens", "max_num_draft_tokens", "schedule", "draft_weights", "prefix_draft")
PREFIX_FIELDS = ("chunk_tokens", "cache_salt")


class GenerateCommand(Command):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--prompt", help="prompt text")
        source.add_argument("--prompt-file", type=Path, help="read the prompt from this UTF-8 file (- reads stdin)")
        _add_model_arguments(parser)
        parser.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
        add_config_flags(parser, GenerationConfig, GENERATION_FIELDS, flags={"stop_strings": ["--stop"]})
        parser.add_argument(
            "--compressor", help="decode from a KV cache compressed by this method (lossy; see `kvlab ls`)"
        )
        parser.add_argument(
            "--compressor-arg",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a compressor parameter, e.g. compression_ratio=0.9 or bits=4 (repeatable)",
        )
        lossless = parser.add_argument_group("lossless speculative decoding (identical greedy output in float32)")
        lossless.add_argument("--lossless", action="store_true", help="draft from a compressed cache, verify with the "
                              "full one; greedy output equals plain decoding with --dtype float32 only (in bfloat16/"
                              "float16 a verify forward over k tokens rounds differently from k single steps, so "
                              "tokens may differ; --json reports lossless_exact)")
        lossless.add_argument(
            "--drafter", default="snapkv",
            help="compressor whose cache drafts; ngram+NAME also drafts by prompt lookup (e.g. ngram+snapkv)",
        )
        lossless.add_argument(
            "--drafter-arg", action="append", default=[], metavar="KEY=VALUE", help="drafter parameter"
        )
        add_config_flags(
            lossless, LosslessConfig, LOSSLESS_FIELDS,
            flags={"num_draft_tokens": ["--num-draft-tokens", "--draft-length"]},
        )
        reuse = parser.add_argument_group("prefix reuse through a KV store")
        reuse.add_argument(
            "--prefix-store", metavar="URL",
            help="restore the prompt's stored leading chunks from, and save new ones to, this store "
            "(memory://, file:///dir, redis://host:port/db)",
        )
        add_config_flags(
            reuse, PrefixConfig, PREFIX_FIELDS,
            flags={"chunk_tokens": ["--prefix-chunk-tokens"], "cache_salt": ["--prefix-salt"]},
        )
        reuse.add_argument(
            "--prefix-resolutions", metavar="NAMES",
            help="comma-separated resolutions to save and fetch: exact (default, output identical), raw, int8, "
            "int4 (fetched when faster; int8/int4 change the output)",
        )
        add_json_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        text = _read_prompt(args)
        config = GenerationConfig(**given_values(args, GenerationConfig, GENERATION_FIELDS))
        compressor = _compressor(args)
        lossless = _lossless_config(args)
        prefix_config = _prefix_config(args)
        loaded = load_configured_model(args)
        prefix = None if prefix_config is None else PrefixCache.for_model(loaded, args.prefix_store, prefix_config)
        prompt_ids = loaded.encode_prompt(text, raw=args.raw)
        # Text streams to stdout as it is generated (not with --json); an interrupt keeps what was shown.
        stream = None if args.json else TextStream(loaded.decode, config.stop_strings, sys.stdout)
        try:
            with TokenProgress(total=config.max_new_tokens, first_phase="prefill") as progress:
                if stream is not None and sys.stdout.isatty():
                    stream.on_first = progress.close  # a bar would interleave with the streamed text
                output: GenerationOutput
                if lossless is not None:
                    output = generate_lossless(
                        loaded, [prompt_ids], config, lossless, progress.update, prefix=prefix, on_tokens=stream
                    )
                else:
                    output = generate(
                        loaded, [prompt_ids], config, progress.update, compressor, prefix=prefix, on_tokens=stream
                    )
            _report(loaded, output, compressor, stream)
        finally:
            if prefix is not None:
                prefix.close()  # the chunks this prompt computed are written before exiting
        return EXIT_OK


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Which model, and how its forwards run."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias, .gguf file, model dir or cached hub id")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and KV dtype")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    parser.add_argument(
        "--unpacked-weights",
        action="store_true",
        help="run linear layers through transformers' own F.linear (logits bit-identical to transformers') "
        "instead of oneDNN-packed weights",
    )
    parser.add_argument(
        "--compile-forward",
        action="store_true",
        help="run each forward as one graph compiled by torch.compile (Llama-family models): faster decode "
        "steps after 30-75 s of compiling per weight set on the first forward",
    )


def _prefix_config(args: argparse.Namespace) -> PrefixConfig | None:
    given = given_values(args, PrefixConfig, PREFIX_FIELDS)
    if args.prefix_store is None:
        if given or args.prefix_resolutions is not None:
            raise ConfigError("--prefix-chunk-tokens, --prefix-resolutions and --prefix-salt need --prefix-store")
        return None
    names = tuple(name.strip() for name in (args.prefix_resolutions or "exact").split(",") if name.strip())
    return PrefixConfig.for_decoding(names, getattr(args, "prefix_draft", None), **given)


def _lossless_config(args: argparse.Namespace) -> LosslessConfig | None:
    given = given_values(args, LosslessConfig, LOSSLESS_FIELDS)
    if not args.lossless:
        if args.drafter_arg or given:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in ("drafter_arg", *LOSSLESS_FIELDS))
            raise ConfigError(f"{flags} need --lossless")
        return None
    if given.get("prefix_draft") and not args.prefix_store:
        raise ConfigError("--prefix-draft drafts from a stored prefix: add --prefix-store URL")
    if args.compressor is not None:
        raise ConfigError("--compressor decodes lossily; with --lossless choose the drafter with --drafter")
    lookup, name = split_drafter_name(args.drafter)
    return LosslessConfig(compressors.create_from_strings(name, args.drafter_arg), prompt_lookup=lookup, **given)


def _compressor(args: argparse.Namespace) -> Compressor | None:
    if args.compressor is None:
        if args.compressor_arg:
            raise ConfigError("--compressor-arg needs --compressor")
        return None
    return compressors.create_from_strings(args.compressor, args.compressor_arg)


def _read_prompt(args: argparse.Namespace) -> str:
    text = str(args.prompt) if args.prompt is not None else read_prompt_file(args.prompt_file)
    if not text.strip():
        raise ConfigError("the prompt is empty; pass some text with --prompt or --prompt-file")
    return text


def _report(
    loaded: LoadedModel, output: GenerationOutput, compressor: Compressor | None, stream: TextStream | None
) -> None:
    request = output.requests[0]
    stats = dataclasses.asdict(output.stats)
    if isinstance(output, LosslessOutput):
        rounds = output.lossless
        stats.update(
            acceptance_length=rounds.acceptance_length,
            rounds=rounds.rounds,
            num_plain_rounds=rounds.num_plain_rounds,
            num_lookup_rounds=rounds.num_lookup_rounds,
            num_plans=rounds.num_plans,
            cost_model={"ticks": rounds.cost_model_ticks, "mean_relative_error": rounds.cost_model_mre,
                        "coefficients": rounds.cost_model_coefficients},
            num_draft_tokens=rounds.num_draft_tokens,
            num_accepted_tokens=rounds.num_accepted_tokens,
            draft_s=rounds.draft_s,
            verify_s=rounds.verify_s,
            kv_load_s=rounds.kv_load_s,
            lossless_exact=lossless_exact(loaded.dtype),
        )
    if stream is None:
        print_json(
            {
                "model": loaded.name,
                "text": request.text,
                "token_ids": request.token_ids,
                "prompt_token_ids": request.prompt_token_ids,
                "stop_reason": request.stop_reason,
                "compressor": compressor.to_dict() if compressor else None,
                "stats": stats,
            }
        )
        return
    stream.finish(request.text)
    print(
        f"\n[{loaded.name}] prompt {stats['prompt_tokens']} tokens, generated {stats['new_tokens']} "
        f"({request.stop_reason}); TTFT {stats['ttft_s']:.2f} s, decode {stats['decode_tokens_per_s']:.1f} tokens/s, "
        f"KV {stats['kv_bytes'] / 2**20:.1f} MiB ({stats['kv_bytes_ratio']:.2f}x smaller than fp16)",
        file=sys.stderr,
    )
    if output.stats.prefix_fetches:
        fetch = output.stats.prefix_fetches[0]
        failure = f"; stopped early: {fetch.failure}" if fetch.failure else ""
        print(
            f"prefix store: reused {fetch.fetched_tokens} of {stats['prompt_tokens']} prompt tokens "
            f"({fetch.nbytes / 2**20:.1f} MiB in {fetch.fetch_s:.2f} s{failure})",
            file=sys.stderr,
        )
    if isinstance(output, LosslessOutput):
        print(
            f"lossless: {output.lossless.rounds} rounds, acceptance length {output.lossless.acceptance_length:.1f} "
            f"({output.lossless.num_accepted_tokens}/{output.lossless.num_draft_tokens} drafts accepted)",
            file=sys.stderr,
        )
