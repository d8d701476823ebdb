"""The `kvlab` command: `main(argv) -> exit code`, one class per subcommand."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvlab import __version__
from kvlab.threads import configure_wait_policy

# Before any command module loads torch: the OpenMP runtime reads its wait policy once.
configure_wait_policy()

from kvlab.cli.base import EXIT_OK, EXIT_RUNTIME_ERROR, EXIT_USAGE_ERROR, Command, add_subcommand
from kvlab.cli.bench import BenchCommand
from kvlab.cli.codec import CodecCommand
from kvlab.cli.demo import DemoCommand
from kvlab.cli.generate import GenerateCommand
from kvlab.cli.ls import ListCommand
from kvlab.cli.store import StoreCommand
from kvlab.errors import ConfigError

COMMANDS: tuple[type[Command], ...] = (
    GenerateCommand, DemoCommand, ListCommand, CodecCommand, BenchCommand, StoreCommand
)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    parser = argparse.ArgumentParser(prog="kvlab", description="KV-cache compression you can trust.")
    parser.add_argument("--version", action="version", version=f"kvlab {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details and show tracebacks")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {}
    for command_class in COMMANDS:
        command = command_class()
        subparser = add_subcommand(subparsers, command.name, command.help)
        command.add_arguments(subparser)
        commands[command.name] = command
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = build_parser()
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
        print(f"kvlab {args.command}: failed: {type(error).__name__}: {error} (rerun with -v for details)", file=sys.stderr)
        return EXIT_RUNTIME_ERROR


def entry_point() -> None:
    sys.exit(main())
