"""`kvlab serve`: an OpenAI-compatible server (torch, transformers and the HTTP stack load in `run`)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.cli.base import Command
from kvlab.cli.flags import add_config_flags, given_values
from kvlab.errors import ConfigError
from kvlab.serve.config import ServeConfig

if TYPE_CHECKING:
    from kvlab.serve.server import ServerStart

logger = logging.getLogger(__name__)

API_KEY_ENV = "KVLAB_API_KEY"
# Flag groups of ServeConfig's fields, in the order `--help` shows them (the API key is no flag: a
# command line shows in `ps`, so it comes from --api-key-file or KVLAB_API_KEY).
GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "dtype", "device", "unpacked_weights", "compile_forward"),
    "network and access": ("host", "port", "allowed_hosts", "allowed_origins", "metrics_prefix"),
    "limits": ("max_num_seqs", "max_queued_requests", "max_prompt_tokens", "max_tokens_limit", "max_tokens_in_system",
               "max_tokens_per_request", "prefill_chunk_tokens", "shutdown_timeout_s"),
    "default decoding (a request overrides it in its \"kvlab\" field)": (
        "mode", "drafter", "drafter_args", "num_draft_tokens", "draft_weights", "allowed_draft_weights",
    ),
    "prefix reuse": ("prefix_store", "prefix_chunk_tokens", "fetch_workers", "max_cache_salts"),
}
FIELDS = tuple(name for names in GROUPS.values() for name in names)
FLAGS = {
    "drafter_args": ["--drafter-arg"],
    "num_draft_tokens": ["--num-draft-tokens", "--draft-length"],
    "shutdown_timeout_s": ["--shutdown-timeout"],
}
# Flags whose values may also list several entries separated by commas.
LISTS = ("allowed_hosts", "allowed_origins", "allowed_draft_weights")


class ServeCommand(Command):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        for title, names in GROUPS.items():
            group = parser.add_argument_group(title)
            add_config_flags(group, ServeConfig, names, flags=FLAGS)
            if "mode" in names:
                group.add_argument("--lossless", action="store_const", const="lossless", dest="mode",
                                   default=argparse.SUPPRESS, help="same as --mode lossless")
            if "host" in names:
                group.add_argument("--api-key-file", type=Path, metavar="PATH", default=argparse.SUPPRESS,
                                   help=f"file holding the key clients send as 'Authorization: Bearer KEY' "
                                        f"(or set {API_KEY_ENV}); needed to bind beyond loopback")
                # Spelled out so that it is refused by name rather than taken as an abbreviation of --api-key-file.
                group.add_argument("--api-key", dest="api_key_given", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def run(self, args: argparse.Namespace) -> int:
        config = config_from_args(args)
        from kvlab.serve.server import run_server  # torch, transformers and uvicorn load here

        code = run_server(config, verbose=bool(getattr(args, "verbose", False)), on_start=print_banner)
        # The interpreter's last collections walk every object torch and transformers made: about a second
        # of CPU, several on a loaded machine, past the shutdown timeout. Nothing left is worth collecting.
        gc.freeze()
        return code


def print_banner(start: ServerStart) -> None:
    """What a started server serves, and its limits (on stderr: stdout stays free for data)."""
    config = start.config
    print(
        f"kvlab serve: {start.model_name} on {start.url} (mode {config.mode}; {config.max_num_seqs} running, "
        f"{config.max_queued_requests} queued at most, {config.tokens_per_request} tokens per request)",
        file=sys.stderr,
        flush=True,
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The server's settings from the flags given; the API key from --api-key-file or KVLAB_API_KEY.

    Raises:
        ConfigError: A key was given on the command line, the key file cannot be read or is empty, or a
            setting is out of range.
    """
    if hasattr(args, "api_key_given"):
        raise ConfigError(
            f"--api-key is refused: a command line is visible to every user of the machine (ps); "
            f"put the key in a file only you can read and pass --api-key-file PATH, or set {API_KEY_ENV}"
        )
    values = given_values(args, ServeConfig, FIELDS)
    for name in LISTS:
        if name in values:
            values[name] = tuple(part.strip() for value in values[name] for part in value.split(",") if part.strip())
    if hasattr(args, "api_key_file"):
        values["api_key"] = read_api_key(args.api_key_file)
    elif os.environ.get(API_KEY_ENV):
        values["api_key"] = os.environ[API_KEY_ENV]
    return ServeConfig(**values)


def read_api_key(path: Path) -> str:
    """The key in `path` (surrounding whitespace dropped); warns when others than its owner may read it.

    Raises:
        ConfigError: The file cannot be read, or holds no key.
    """
    try:
        mode = path.stat().st_mode
        key = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read the API key file {path}: {error}") from None
    if not key:
        raise ConfigError(f"the API key file {path} is empty")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("the API key file %s is readable by other users (mode %o); restrict it with chmod 600 %s",
                       path, stat.S_IMODE(mode), path)
    return key
