"""`kvlab demo`: a batch over one long document decoded with the full KV cache, lossily, and losslessly."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from kvlab.cli.base import EXIT_OK, Command, add_json_flag, print_json, read_prompt_file
from kvlab.cli.flags import add_config_flags, given_values
from kvlab.cli.progress import TokenProgress
from kvlab.compress import compressors
from kvlab.engine import compare_modes
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessConfig, LosslessOutput
from kvlab.models import DEFAULT_MODEL, load_model

DEMO_DEFAULTS = {"max_new_tokens": 48, "full_kv_tier": "emulated:0.5"}

QUESTIONS = (
    "Summarize the text above in a few sentences.",
    "What are the key points of the text above?",
    "Explain the main idea of the text above to a beginner.",
    "Write three questions a reader might ask about the text above.",
)


class DemoCommand(Command):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--prompt-file", type=Path, required=True, help="UTF-8 document, - reads stdin (chat template applied)"
        )
        parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded alias, .gguf file, model dir")
        parser.add_argument("--batch", type=int, default=4, choices=range(1, len(QUESTIONS) + 1), metavar="N",
                            help=f"questions about the document decoded together (1-{len(QUESTIONS)})")
        # A 0.5 GB/s link makes the full KV's bytes dominate a step, the setting lossless decoding is for.
        add_config_flags(parser, GenerationConfig, ("max_new_tokens", "full_kv_tier"), defaults=DEMO_DEFAULTS)
        parser.add_argument("--compressor", default="snapkv", help="lossy cache, also the lossless drafter")
        parser.add_argument(
            "--compressor-arg", action="append", default=None, metavar="KEY=VALUE",
            help="compressor parameter (default: compression_ratio=0.9)",
        )
        add_config_flags(
            parser, LosslessConfig, ("num_draft_tokens",),
            flags={"num_draft_tokens": ["--num-draft-tokens", "--draft-length"]},
        )
        add_json_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        document = read_prompt_file(args.prompt_file)
        compressor = compressors.create_from_strings(args.compressor, args.compressor_arg or ["compression_ratio=0.9"])
        lossless = LosslessConfig(compressor, **given_values(args, LosslessConfig, ("num_draft_tokens",)))
        config = GenerationConfig(
            **{**DEMO_DEFAULTS, **given_values(args, GenerationConfig, ("max_new_tokens", "full_kv_tier"))}
        )
        loaded = load_model(args.model)
        prompts = [loaded.encode_prompt(f"{document}\n\n{question}") for question in QUESTIONS[: args.batch]]
        with TokenProgress(total=3 * args.batch * config.max_new_tokens, enabled=not args.json) as progress:
            results = compare_modes(loaded, prompts, config, compressor, lossless, progress.update)
        if args.json:
            print_json(
                {
                    "prompt_tokens": [len(prompt) for prompt in prompts],
                    "full_kv_tier": config.full_kv_tier,
                    "modes": [
                        {
                            "mode": r.mode,
                            "texts": [request.text for request in r.output.requests],
                            "identical_to_full": r.identical_to_full,
                            "first_divergence": r.first_divergence,
                            "decode_tokens_per_s": r.output.stats.decode_tokens_per_s,
                            "decode_speedup_vs_full": r.speedup,
                            "tier_bytes_per_token": r.tier_bytes_per_token,
                            "kv_bytes_ratio": r.output.stats.kv_bytes_ratio,
                            "acceptance_length": r.output.lossless.acceptance_length
                            if isinstance(r.output, LosslessOutput)
                            else None,
                        }
                        for r in results
                    ],
                }
            )
            return EXIT_OK
        print(
            f"{args.batch} questions about {args.prompt_file} ({len(prompts[0])} tokens each), decoded together; "
            f"full KV on tier {config.full_kv_tier}; compressor {compressor.to_dict()}\n"
        )
        print(f"{'mode':<9} {'output':<24} {'decode tok/s':>12} {'vs full':>8} {'full KV read/token':>19}  acceptance")
        for result in results:
            verdict = (
                "identical to full KV" if result.identical_to_full else f"differs at token {result.first_divergence}"
            )
            acceptance = (
                f"{result.output.lossless.acceptance_length:.1f} tokens/round"
                if isinstance(result.output, LosslessOutput)
                else "-"
            )
            print(
                f"{result.mode:<9} {verdict:<24} {result.output.stats.decode_tokens_per_s:>12.1f} "
                f"{result.speedup:>7.2f}x {result.tier_bytes_per_token / 2**20:>15.1f} MiB  {acceptance}"
            )
        for result in results:
            print(f"\n== {result.mode}, question 1:")
            print(textwrap.indent(textwrap.fill(result.output.requests[0].text.strip(), 100), "   "))
        return EXIT_OK
