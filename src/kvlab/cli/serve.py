"""`kvlab serve`: an OpenAI-compatible server (torch, transformers and the HTTP stack load in `run`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from kvlab.cli.base import Command
from kvlab.errors import ConfigError
from kvlab.serve.config import MODES, ServeConfig

API_KEY_ENV = "KVLAB_API_KEY"
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # kvlab.models.DTYPES, without importing torch
DRAFT_WEIGHT_NAMES = ("same", "bf16", "int8")  # kvlab.models.draft_weights.DRAFT_WEIGHTS


def _help(name: str) -> str:
    field = next(f for f in dataclasses.fields(ServeConfig) if f.name == name)
    return str(field.metadata["help"])


class ServeCommand(Command):
    name = "serve"
    help = "serve the model over an OpenAI-compatible HTTP API (continuous batching, lossless decoding)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        defaults = ServeConfig()
        parser.add_argument("--model", help=_help("model") + " (default: the embedded model)")
        parser.add_argument("--dtype", default=defaults.dtype, choices=DTYPE_NAMES, help=_help("dtype"))
        parser.add_argument("--device", default=defaults.device, help=_help("device"))
        net = parser.add_argument_group("network and access")
        net.add_argument("--host", default=defaults.host, help=_help("host"))
        net.add_argument("--port", type=int, default=defaults.port, help=_help("port"))
        net.add_argument("--api-key", help=_help("api_key"))
        limits = parser.add_argument_group("limits")
        for name in ("max_num_seqs", "max_queued_requests", "max_prompt_tokens", "max_tokens_limit", "prefill_chunk_tokens"):
            limits.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name), help=_help(name))
        limits.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float,
                            default=defaults.shutdown_timeout_s, help=_help("shutdown_timeout_s"))
        decoding = parser.add_argument_group("default decoding (requests override with their \"kvlab\" field)")
        decoding.add_argument("--mode", default=defaults.mode, choices=MODES, help=_help("mode"))
        decoding.add_argument("--lossless", action="store_const", const="lossless", dest="mode", help="same as --mode lossless")
        decoding.add_argument("--drafter", default=defaults.drafter, help=_help("drafter"))
        decoding.add_argument("--drafter-arg", action="append", default=[], metavar="KEY=VALUE", help=_help("drafter_args"))
        decoding.add_argument("--num-draft-tokens", "--draft-length", dest="num_draft_tokens", default="auto",
                              help=_help("num_draft_tokens"))
        decoding.add_argument("--draft-weights", default=defaults.draft_weights, choices=DRAFT_WEIGHT_NAMES,
                              help=_help("draft_weights"))
        reuse = parser.add_argument_group("prefix reuse")
        reuse.add_argument("--prefix-store", metavar="URL", help=_help("prefix_store"))
        reuse.add_argument("--prefix-chunk-tokens", type=int, default=defaults.prefix_chunk_tokens, help=_help("prefix_chunk_tokens"))
        reuse.add_argument("--fetch-workers", type=int, default=defaults.fetch_workers, help=_help("fetch_workers"))
        reuse.add_argument("--max-cache-salts", type=int, default=defaults.max_cache_salts, help=_help("max_cache_salts"))

    def run(self, args: argparse.Namespace) -> int:
        config = config_from_args(args)
        from kvlab.serve.server import run_server  # torch, transformers and uvicorn load here

        return run_server(config, verbose=bool(getattr(args, "verbose", False)))


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The server's settings from parsed flags (the API key may come from KVLAB_API_KEY)."""
    num_draft_tokens: Any = args.num_draft_tokens
    if num_draft_tokens != "auto":
        try:
            num_draft_tokens = int(num_draft_tokens)
        except ValueError:
            raise ConfigError(f"--num-draft-tokens must be a positive integer or 'auto', got {num_draft_tokens!r}") from None
        if num_draft_tokens < 1:
            raise ConfigError(f"--num-draft-tokens must be a positive integer or 'auto', got {num_draft_tokens}")
    return ServeConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_num_seqs=args.max_num_seqs,
        max_queued_requests=args.max_queued_requests,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        shutdown_timeout_s=args.shutdown_timeout_s,
        mode=args.mode,
        drafter=args.drafter,
        drafter_args=tuple(args.drafter_arg),
        num_draft_tokens=num_draft_tokens,
        draft_weights=args.draft_weights,
        prefix_store=args.prefix_store,
        prefix_chunk_tokens=args.prefix_chunk_tokens,
        fetch_workers=args.fetch_workers,
        max_cache_salts=args.max_cache_salts,
    )
