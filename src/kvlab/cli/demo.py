"""`kvlab demo`: the same long prompt decoded with the full cache, lossily, and losslessly."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from kvlab.cli.base import EXIT_OK, Command, add_json_flag, print_json
from kvlab.compress import compressors
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessConfig, LosslessOutput
from kvlab.lossless.compare import compare_modes
from kvlab.models import DEFAULT_MODEL, load_model


class DemoCommand(Command):
    name = "demo"
    help = "decode one long prompt with the full KV cache, a lossy compressed cache, and losslessly"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--prompt-file", type=Path, required=True, help="UTF-8 prompt (chat template applied)")
        parser.add_argument("--model", default=DEFAULT_MODEL)
        parser.add_argument("--max-new-tokens", type=int, default=96)
        parser.add_argument("--compressor", default="streamingllm", help="lossy cache, also the lossless drafter")
        parser.add_argument(
            "--compressor-arg", action="append", default=None, metavar="KEY=VALUE",
            help="compressor parameter (default: compression_ratio=0.9)",
        )
        parser.add_argument("--draft-length", default="auto")
        add_json_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        if not args.prompt_file.is_file():
            raise ConfigError(f"prompt file not found: {args.prompt_file}")
        compressor = compressors.create_from_strings(args.compressor, args.compressor_arg or ["compression_ratio=0.9"])
        draft_length = args.draft_length if args.draft_length == "auto" else int(args.draft_length)
        spec = LosslessConfig(compressor, draft_length)
        loaded = load_model(args.model)
        prompt = loaded.encode_prompt(args.prompt_file.read_text(encoding="utf-8"))
        results = compare_modes(loaded, prompt, GenerationConfig(max_new_tokens=args.max_new_tokens), compressor, spec)
        if args.json:
            print_json(
                [
                    {
                        "mode": r.mode,
                        "text": r.output.requests[0].text,
                        "identical_to_full": r.identical_to_full,
                        "first_divergence": r.first_divergence,
                        "decode_speedup_vs_full": r.speedup,
                        "kv_bytes_ratio": r.output.stats.kv_bytes_ratio,
                        "acceptance_length": r.output.lossless.acceptance_length if isinstance(r.output, LosslessOutput) else None,
                    }
                    for r in results
                ]
            )
            return EXIT_OK
        print(f"prompt: {len(prompt)} tokens of {args.prompt_file}; compressor {compressor.to_dict()}\n")
        for result in results:
            stats = result.output.stats
            verdict = "identical to full KV" if result.identical_to_full else f"diverges at token {result.first_divergence}"
            extra = f", acceptance length {result.output.lossless.acceptance_length:.1f}" if isinstance(result.output, LosslessOutput) else ""
            # Lossless mode keeps the full KV for verification; the ratio is that of the drafter's cache.
            which = "draft KV" if isinstance(result.output, LosslessOutput) else "KV"
            print(f"== {result.mode}: {verdict}; {which} {stats.kv_bytes_ratio:.1f}x smaller than fp16, "
                  f"decode {stats.decode_tokens_per_s:.1f} tok/s ({result.speedup:.2f}x full){extra}")
            print(textwrap.indent(textwrap.fill(result.output.requests[0].text.strip(), 100), "   "), "\n")
        return EXIT_OK
