"""The `kvlab` command: `main(argv) -> exit code`, one class per subcommand."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from kvlab.threads import prefer_passive_waits

# Before any command module loads torch: the OpenMP runtime reads its wait policy once.
prefer_passive_waits()

from kvlab.cli.base import EXIT_OK, EXIT_RUNTIME_ERROR, EXIT_USAGE_ERROR, Command
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
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details and show tracebacks")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = {}
    for command_class in COMMANDS:
        command = command_class()
        command.add_arguments(subparsers.add_parser(command.name, help=command.help, description=command.help))
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
    except Exception as error:
        if args.verbose or os.environ.get("KVLAB_DEBUG"):
            raise
        print(f"kvlab {args.command}: failed: {type(error).__name__}: {error} (rerun with -v for details)", file=sys.stderr)
        return EXIT_RUNTIME_ERROR


def entry_point() -> None:
    sys.exit(main())
