"""What every `kvlab` subcommand shares: registration, exit codes and output helpers."""

from __future__ import annotations

import abc
import argparse
import json
import sys
from typing import Any, ClassVar

EXIT_OK = 0
EXIT_RUNTIME_ERROR = 1
EXIT_USAGE_ERROR = 2


class Command(abc.ABC):
    """One `kvlab` verb: declares its arguments and runs with the parsed namespace."""

    name: ClassVar[str]
    help: ClassVar[str]

    @abc.abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    @abc.abstractmethod
    def run(self, args: argparse.Namespace) -> int: ...


def print_json(payload: Any) -> None:
    json.dump(payload, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
