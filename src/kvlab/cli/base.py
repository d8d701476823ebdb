"""What every `kvlab` subcommand shares: registration, exit codes and output helpers."""

from __future__ import annotations

import abc
import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError

EXIT_OK = 0
EXIT_RUNTIME_ERROR = 1
EXIT_USAGE_ERROR = 2


class Command(abc.ABC):
    """One `kvlab` verb: declares its arguments and runs with the parsed namespace (its name and help
    are in `kvlab.cli.COMMANDS`)."""

    @abc.abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    @abc.abstractmethod
    def run(self, args: argparse.Namespace) -> int: ...


def add_subcommand(
    subparsers: argparse._SubParsersAction, name: str, help: str  # type: ignore[type-arg]
) -> argparse.ArgumentParser:
    """A (sub)command's parser: defaults shown in its help, and `-v` accepted after its name too."""
    # SUPPRESS keeps a `-v` given earlier on the command line when this one is absent.
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return subparsers.add_parser(  # type: ignore[no-any-return]
        name, help=help, description=help, parents=[verbose], formatter_class=DefaultsHelpFormatter
    )


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default in its help, unless there is nothing to show (unset, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], ()) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def read_prompt_file(path: Path) -> str:
    """The UTF-8 text of `path`; `-` (or /dev/stdin) reads standard input, as Unix tools do.

    Raises:
        ConfigError: The file does not exist or is not UTF-8 text.
    """
    try:
        if str(path) == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        if not path.exists() or path.is_dir():
            raise ConfigError(f"prompt file not found: {path}")
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"prompt file {path} is not UTF-8 text ({error.reason})") from None


def print_json(payload: Any) -> None:
    json.dump(payload, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
