"""`kvlab generate`: continue one prompt with the chosen model and print the answer and its stats."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from kvlab.cli.base import EXIT_OK, Command, add_json_flag, print_json, read_prompt_file
from kvlab.cli.progress import TextStream, TokenProgress
from kvlab.compress import Compressor, compressors
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig, GenerationOutput, generate
from kvlab.lossless import LosslessConfig, LosslessOutput, generate_lossless
from kvlab.models import DEFAULT_MODEL, DTYPES, LoadedModel, load_model
from kvlab.models.draft_weights import DRAFT_WEIGHTS
from kvlab.store.prefix import PrefixCache, PrefixConfig


class GenerateCommand(Command):
    name = "generate"
    help = "generate a continuation of a prompt"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        source = parser.add_mutually_exclusive_group(required=True)
        source.add_argument("--prompt", help="prompt text")
        source.add_argument("--prompt-file", type=Path, help="read the prompt from this UTF-8 file (- reads stdin)")
        parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias, .gguf file, model dir or cached hub id")
        parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and KV dtype")
        parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
        parser.add_argument("--max-new-tokens", type=int, default=256, help="upper limit on generated tokens")
        parser.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
        parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
        parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
        parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
        parser.add_argument("--stop", action="append", default=[], help="stop once the text contains this (repeatable)")
        parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
        parser.add_argument(
            "--full-kv-tier", default="memory", metavar="TIER",
            help="where the full KV lives while decoding: memory (default), host, disk (O_DIRECT reads), or "
            "emulated:GBPS (reads pass a GBPS GB/s token bucket)",
        )
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
        lossless = parser.add_argument_group("lossless speculative decoding (output identical to the full cache)")
        lossless.add_argument("--lossless", action="store_true", help="draft from a compressed cache, verify with the full one")
        lossless.add_argument("--drafter", default="snapkv", help="compressor whose cache drafts (default snapkv)")
        lossless.add_argument("--drafter-arg", action="append", default=[], metavar="KEY=VALUE", help="drafter parameter")
        lossless.add_argument(
            "--num-draft-tokens", "--draft-length", dest="num_draft_tokens", default="auto",
            help="tokens drafted per round, or 'auto' (default: adapted per sequence)",
        )
        lossless.add_argument(
            "--schedule",
            default="staggered",
            choices=("staggered", "synchronous"),
            help="load a sequence's full KV while it drafts (staggered) or when it verifies",
        )
        lossless.add_argument(
            "--prefix-draft", choices=("int8", "int4"),
            help="with --prefix-store: draft from this low-bit copy of the stored prefix while the exact one "
            "transfers (it is saved alongside the exact chunks)",
        )
        lossless.add_argument(
            "--draft-weights", default="same", choices=DRAFT_WEIGHTS,
            help="draft with the model itself or a bf16/int8-weight copy (verification stays exact)",
        )
        reuse = parser.add_argument_group("prefix reuse through a KV store")
        reuse.add_argument(
            "--prefix-store", metavar="URL",
            help="restore the prompt's stored leading chunks from, and save new ones to, this store "
            "(memory://, file:///dir, redis://host:port/db)",
        )
        reuse.add_argument("--prefix-chunk-tokens", type=int, default=256, help="tokens per stored chunk")
        reuse.add_argument(
            "--prefix-salt", metavar="TEXT",
            help="namespace of this tenant's keys: other salts can neither read nor probe them (like cache_salt)",
        )
        reuse.add_argument(
            "--prefix-resolutions", default="exact", metavar="NAMES",
            help="comma-separated resolutions to save and fetch: exact (default, output identical), raw, int8, "
            "int4 (fetched when faster; int8/int4 change the output)",
        )
        add_json_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        text = _read_prompt(args)
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop_strings=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            full_kv_tier=args.full_kv_tier,
        )
        compressor = _compressor(args)
        lossless = _lossless_config(args)
        prefix_config = _prefix_config(args)
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
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


def _prefix_config(args: argparse.Namespace) -> PrefixConfig | None:
    if args.prefix_store is None:
        if args.prefix_resolutions != "exact" or args.prefix_chunk_tokens != 256 or args.prefix_salt:
            raise ConfigError("--prefix-chunk-tokens, --prefix-resolutions and --prefix-salt need --prefix-store")
        return None
    names = tuple(name.strip() for name in args.prefix_resolutions.split(",") if name.strip())
    low_bit = (args.prefix_draft,) if args.prefix_draft and args.prefix_draft not in names else ()
    return PrefixConfig(
        chunk_tokens=args.prefix_chunk_tokens, write=names + low_bit, fetch=names, cache_salt=args.prefix_salt
    )


def _lossless_config(args: argparse.Namespace) -> LosslessConfig | None:
    if not args.lossless:
        if args.drafter_arg or args.num_draft_tokens != "auto" or args.draft_weights != "same" or args.prefix_draft:
            raise ConfigError("--drafter-arg, --num-draft-tokens, --draft-weights and --prefix-draft need --lossless")
        return None
    if args.prefix_draft and not args.prefix_store:
        raise ConfigError("--prefix-draft drafts from a stored prefix: add --prefix-store URL")
    if args.compressor is not None:
        raise ConfigError("--compressor decodes lossily; with --lossless choose the drafter with --drafter")
    num_draft_tokens: int | str = args.num_draft_tokens
    if num_draft_tokens != "auto":
        try:
            num_draft_tokens = int(num_draft_tokens)
        except ValueError:
            raise ConfigError(f"--num-draft-tokens must be a positive integer or 'auto', got {num_draft_tokens!r}") from None
    drafter = compressors.create_from_strings(args.drafter, args.drafter_arg)
    return LosslessConfig(
        drafter,
        num_draft_tokens,  # type: ignore[arg-type]
        schedule=args.schedule,
        draft_weights=args.draft_weights,
        prefix_draft=args.prefix_draft,
    )


def _compressor(args: argparse.Namespace) -> Compressor | None:
    if args.compressor is None:
        if args.compressor_arg:
            raise ConfigError("--compressor-arg needs --compressor")
        return None
    return compressors.create_from_strings(args.compressor, args.compressor_arg)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        text = str(args.prompt)
    else:
        text = read_prompt_file(args.prompt_file)
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
            num_draft_tokens=rounds.num_draft_tokens,
            num_accepted_tokens=rounds.num_accepted_tokens,
            draft_s=rounds.draft_s,
            verify_s=rounds.verify_s,
            kv_load_s=rounds.kv_load_s,
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
