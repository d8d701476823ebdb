"""The `kvlab` command: `main(argv) -> exit code`, one class per subcommand."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from kvlab import __version__
from kvlab.threads import configure_wait_policy

# Before any command module loads torch: the OpenMP runtime reads its wait policy once.
configure_wait_policy()

# Kept below configure_wait_policy() on purpose: it must run before any import that could load torch.
from kvlab.cli.base import EXIT_OK, EXIT_RUNTIME_ERROR, EXIT_USAGE_ERROR, Command, add_subcommand  # noqa: E402
from kvlab.errors import ConfigError  # noqa: E402

# name -> (module, class, help). A command's module (and with it torch and transformers) is imported
# only when that command runs, so `kvlab --help`, `--version` and a mistyped command answer at once.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("kvlab.cli.generate", "GenerateCommand", "generate a continuation of a prompt"),
    "demo": (
        "kvlab.cli.demo", "DemoCommand",
        "decode questions about one long document with the full KV cache, a lossy cache, and losslessly",
    ),
    "ls": ("kvlab.cli.ls", "ListCommand", "list models, compressors, codecs, stores and tasks with their parameters"),
    "codec": (
        "kvlab.cli.codec", "CodecCommand",
        "benchmark KV codecs, or encode/decode KV tensors saved as safetensors",
    ),
    "bench": (
        "kvlab.cli.bench", "BenchCommand",
        "benchmark methods on task quality and system cost; `kvlab bench report DIR` re-renders a report",
    ),
    "store": ("kvlab.cli.store", "StoreCommand", "list, read, write, verify and clear entries of a KV store"),
    "serve": (
        "kvlab.cli.serve", "ServeCommand",
        "serve the model over an OpenAI-compatible HTTP API (continuous batching, lossless decoding)",
    ),
}


def load_command(name: str) -> Command:
    module_name, class_name, _ = COMMANDS[name]
    command: Command = getattr(importlib.import_module(module_name), class_name)()
    return command


def build_parser(argv: Sequence[str] | None = None) -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    """The parser, with the arguments of the command `argv` names (None: of every command)."""
    parser = argparse.ArgumentParser(prog="kvlab", description="KV-cache compression you can trust.")
    parser.add_argument("--version", action="version", version=f"kvlab {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details and show tracebacks")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = set(COMMANDS) if argv is None else {word for word in argv if word in COMMANDS}
    commands = {}
    for name, (_, _, help) in COMMANDS.items():
        subparser = add_subcommand(subparsers, name, help)
        if name in wanted:
            commands[name] = load_command(name)
            commands[name].add_arguments(subparser)
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, commands = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or EXIT_OK)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="kvlab: %(levelname)s: %(message)s"
    )
    try:
        return commands[args.command].run(args)
    except ConfigError as error:
        print(f"kvlab {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE_ERROR
    except KeyboardInterrupt:
        print("kvlab: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`kvlab ls | head`): not a failure; keep Python from reporting it at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as error:
        if args.verbose or os.environ.get("KVLAB_DEBUG"):
            raise
        print(
            f"kvlab {args.command}: failed: {type(error).__name__}: {error} (rerun with -v for details)",
            file=sys.stderr,
        )
        return EXIT_RUNTIME_ERROR


def entry_point() -> None:
    sys.exit(main())
