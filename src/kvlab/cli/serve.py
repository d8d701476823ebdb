"""`kvlab serve`: an OpenAI-compatible server (torch, transformers and the HTTP stack load in `run`)."""

from __future__ import annotations

import argparse
import os

from kvlab.cli.base import Command
from kvlab.cli.flags import add_config_flags, given_values
from kvlab.serve.config import ServeConfig

API_KEY_ENV = "KVLAB_API_KEY"
# Flag groups of ServeConfig's fields, in the order `--help` shows them.
GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "dtype", "device"),
    "network and access": ("host", "port", "api_key"),
    "limits": ("max_num_seqs", "max_queued_requests", "max_prompt_tokens", "max_tokens_limit", "prefill_chunk_tokens",
               "shutdown_timeout_s"),
    "default decoding (a request overrides it in its \"kvlab\" field)": (
        "mode", "drafter", "drafter_args", "num_draft_tokens", "draft_weights",
    ),
    "prefix reuse": ("prefix_store", "prefix_chunk_tokens", "fetch_workers", "max_cache_salts"),
}
FIELDS = tuple(name for names in GROUPS.values() for name in names)
FLAGS = {
    "drafter_args": ["--drafter-arg"],
    "num_draft_tokens": ["--num-draft-tokens", "--draft-length"],
    "shutdown_timeout_s": ["--shutdown-timeout"],
}


class ServeCommand(Command):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        for title, names in GROUPS.items():
            group = parser.add_argument_group(title)
            add_config_flags(group, ServeConfig, names, flags=FLAGS)
            if "mode" in names:
                group.add_argument("--lossless", action="store_const", const="lossless", dest="mode",
                                   default=argparse.SUPPRESS, help="same as --mode lossless")

    def run(self, args: argparse.Namespace) -> int:
        config = config_from_args(args)
        from kvlab.serve.server import run_server  # torch, transformers and uvicorn load here

        return run_server(config, verbose=bool(getattr(args, "verbose", False)))


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The server's settings from the flags given (the API key may come from KVLAB_API_KEY)."""
    values = given_values(args, ServeConfig, FIELDS)
    if "api_key" not in values and os.environ.get(API_KEY_ENV):
        values["api_key"] = os.environ[API_KEY_ENV]
    return ServeConfig(**values)
