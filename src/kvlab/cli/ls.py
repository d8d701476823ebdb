"""`kvlab ls`: every registered component and every embedded model (architecture, context, origin)."""

from __future__ import annotations

import argparse
from typing import Any

from kvlab.cli.base import EXIT_OK, Command, add_json_flag, print_json
from kvlab.components import load_components
from kvlab.models import EMBEDDED_MODELS
from kvlab.registry import all_registries


class ListCommand(Command):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_json_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        load_components()
        listing: dict[str, Any] = {
            "models": [
                {
                    "name": alias,
                    "summary": model.description,
                    "architecture": model.architecture,
                    "context": model.context,
                    "source": model.source,
                    "installed": model.installed(),
                    "install": model.install,
                }
                for alias, model in EMBEDDED_MODELS.items()
            ]
        }
        for kind, registry in sorted(all_registries().items()):
            listing[kind + "s"] = registry.describe()
        if args.json:
            print_json(listing)
            return EXIT_OK
        for section, rows in listing.items():
            print(f"{section}:")
            if not rows:
                print("  (none registered)")
            for row in rows:
                print(f"  {row['name']:<16} {row['summary']}")
                if section == "models":
                    state = "installed" if row["installed"] else f"not installed; {row['install']}"
                    print(f"      {row['architecture']}; context {row['context']} tokens")
                    print(f"      from {row['source']} ({state})")
                for param in row.get("parameters", []):
                    print(f"      {param['name']}: {param['type']} = {param['default']!r}  {param['help']}")
        return EXIT_OK
