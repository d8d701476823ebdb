"""Command-line flags built from config dataclasses.

A config field declares its default, its type (a `Literal` gives the choices) and its help text
(`metadata={"help": ...}`) once; `add_config_flags` turns the fields a command exposes into flags
and `given_values` reads back what the user passed. Flags default to "not given", so the config
class applies its own defaults and a command can tell an explicit value from a default one.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from kvlab.errors import ConfigError
from kvlab.registry import check_type, parse_value, type_name


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config_class: type,
    fields: Sequence[str],
    flags: Mapping[str, Sequence[str]] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add one flag per field of `config_class` named in `fields`.

    Args:
        parser: Parser or argument group to add to.
        config_class: A dataclass whose fields carry `metadata["help"]`.
        fields: Field names to expose, in order.
        flags: Flag spellings per field (default `--field-name`); the first is the canonical one.
        defaults: Defaults this command uses instead of the class's (shown in the help).
    """
    hints = typing.get_type_hints(config_class)
    by_name = {field.name: field for field in dataclasses.fields(config_class)}
    for name in fields:
        field = by_name[name]
        help_text = field.metadata.get("help")
        if not help_text:
            raise TypeError(f"{config_class.__name__}.{name} has no metadata help to show")
        default = (defaults or {}).get(name, _field_default(field))
        annotation = hints[name]
        options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS}
        if annotation is bool:
            options["action"] = "store_true"
        elif typing.get_origin(annotation) is tuple:
            options.update(action="append", type=_value_parser(typing.get_args(annotation)[0]), metavar="TEXT")
            help_text += " (repeatable)"
        else:
            options["type"] = _value_parser(annotation)
            choices = _choices(annotation)
            if choices:
                options["choices"] = choices
            else:
                options["metavar"] = _metavar(annotation)
        if default not in (None, False, ()):
            help_text += f" (default: {default})"
        parser.add_argument(*(flags or {}).get(name, [f"--{name.replace('_', '-')}"]), help=help_text, **options)


def given_values(args: argparse.Namespace, config_class: type, fields: Sequence[str]) -> dict[str, Any]:
    """The values the user gave for `fields` (tuples for repeatable flags); absent fields are left out."""
    hints = typing.get_type_hints(config_class)
    values = {}
    for name in fields:
        if hasattr(args, name):
            value = getattr(args, name)
            values[name] = tuple(value) if typing.get_origin(hints[name]) is tuple else value
    return values


def _field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _value_parser(annotation: Any) -> typing.Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            value = parse_value(raw, annotation)
            check_type("value", value, annotation)
        except ConfigError:
            # argparse turns this into a usage error (exit 2) naming the flag.
            raise argparse.ArgumentTypeError(f"expected {type_name(annotation)}, got {raw!r}") from None
        return value

    parse.__name__ = type_name(annotation)
    return parse


def _choices(annotation: Any) -> list[Any] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return None


def _metavar(annotation: Any) -> str:
    """`INT`, `FLOAT`, `TEXT`, or `INT|auto` for a type with literal alternatives (None is the default)."""
    names = dict.fromkeys(_metavar_parts(annotation))
    return "|".join(names) or "VALUE"


def _metavar_parts(annotation: Any) -> list[str]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [part for arg in typing.get_args(annotation) for part in _metavar_parts(arg)]
    if origin is typing.Literal:
        return [str(value) for value in typing.get_args(annotation)]
    if annotation is type(None):
        return []
    return [{int: "INT", float: "FLOAT", str: "TEXT"}.get(annotation, getattr(annotation, "__name__", "VALUE").upper())]
