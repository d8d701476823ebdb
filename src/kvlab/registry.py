"""One registry mechanism for every pluggable component.

Compressors, codecs, store schemes and benchmark tasks each own a `Registry`. A registered class is a
dataclass whose fields are its parameters; `Registry.create(name, **params)` validates names and
types before constructing, and `Registry.describe()` lists every entry with its parameters for
`kvlab ls`. A component serializes as `{"name": key, **params}` and `Registry.from_dict` rebuilds it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from kvlab.errors import ConfigError

T = TypeVar("T")

_ALL_REGISTRIES: dict[str, Registry[Any]] = {}


@dataclasses.dataclass(frozen=True, slots=True)
class ParameterInfo:
    """One parameter of a registered component, as listed by `kvlab ls`."""

    name: str
    type: str
    default: Any
    help: str


class Registry(Generic[T]):
    """Named constructors of one kind of component.

    Args:
        kind: What the entries are ("compressor", "codec", ...); used in error messages and `kvlab ls`.
    """

    def __init__(self, kind: str) -> None:
        if kind in _ALL_REGISTRIES:
            raise ValueError(f"a registry of kind {kind!r} already exists")
        self.kind = kind
        self._entries: dict[str, type[T]] = {}
        _ALL_REGISTRIES[kind] = self

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator adding the class under `name` (equal to its module name by convention)."""

        def decorator(cls: type[T]) -> type[T]:
            if name in self._entries and self._entries[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = cls
            cls.registry_name = name  # type: ignore[attr-defined]
            return cls

        return decorator

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> type[T]:
        try:
            return self._entries[name]
        except KeyError:
            allowed = ", ".join(self.names()) or "(none registered)"
            raise ConfigError(f"unknown {self.kind} {name!r}; choose one of: {allowed}") from None

    def create(self, name: str, **params: Any) -> T:
        """Build the component `name` from keyword parameters, rejecting unknown or ill-typed ones."""
        cls = self.get(name)
        known = {p.name: p for p in self.parameters(name)}
        unknown = sorted(set(params) - set(known))
        if unknown:
            allowed = ", ".join(known) or "(no parameters)"
            raise ConfigError(f"{self.kind} {name!r} has no parameter {unknown[0]!r}; parameters: {allowed}")
        hints = typing.get_type_hints(cls)
        for key, value in params.items():
            check_type(f"{self.kind} {name!r} parameter {key!r}", value, hints.get(key, Any))
        try:
            return cls(**params)
        except ConfigError:
            raise
        except (TypeError, ValueError) as error:
            raise ConfigError(f"{self.kind} {name!r}: {error}") from error

    def create_from_strings(self, name: str, assignments: list[str]) -> T:
        """Build from CLI-style `key=value` strings, parsing each value by the field's declared type."""
        hints = typing.get_type_hints(self.get(name))
        params: dict[str, Any] = {}
        for assignment in assignments:
            key, sep, raw = assignment.partition("=")
            if not sep or not key:
                raise ConfigError(f"expected key=value, got {assignment!r}")
            params[key.strip()] = parse_value(raw.strip(), hints.get(key.strip(), Any))
        return self.create(name, **params)

    def from_dict(self, spec: dict[str, Any]) -> T:
        """Rebuild a component from `{"name": key, **params}`."""
        params = dict(spec)
        try:
            name = params.pop("name")
        except KeyError:
            raise ConfigError(f"a {self.kind} spec needs a 'name' key, got {sorted(spec)}") from None
        return self.create(name, **params)

    def parameters(self, name: str) -> list[ParameterInfo]:
        cls = self.get(name)
        if not dataclasses.is_dataclass(cls):
            return []
        hints = typing.get_type_hints(cls)
        infos = []
        for field in dataclasses.fields(cls):
            if not field.init or field.name.startswith("_"):
                continue
            default: Any = None
            if field.default is not dataclasses.MISSING:
                default = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            infos.append(
                ParameterInfo(
                    field.name, type_name(hints.get(field.name, Any)), default, field.metadata.get("help", "")
                )
            )
        return infos

    def describe(self) -> list[dict[str, Any]]:
        """Every entry as `{"name", "summary", "parameters": [...]}`, for listing."""
        rows = []
        for name in self.names():
            doc = (self._entries[name].__doc__ or "").strip().splitlines()
            rows.append(
                {
                    "name": name,
                    "summary": doc[0] if doc else "",
                    "parameters": [dataclasses.asdict(p) for p in self.parameters(name)],
                }
            )
        return rows


def to_dict(component: Any) -> dict[str, Any]:
    """`{"name": key, **params}` of a registered dataclass component."""
    params = {
        f.name: getattr(component, f.name)
        for f in dataclasses.fields(component)
        if f.init and not f.name.startswith("_")
    }
    return {"name": type(component).registry_name, **params}


def all_registries() -> dict[str, Registry[Any]]:
    """Every registry created so far, by kind. Importing `kvlab.components` fills them."""
    return dict(_ALL_REGISTRIES)


def parse_value(raw: str, annotation: Any) -> Any:
    """Parse a CLI string into the type a dataclass field declares."""
    for candidate in _candidate_types(annotation):
        if candidate is type(None):
            if raw.lower() in ("none", "null"):
                return None
            continue
        try:
            if candidate is bool:
                lowered = raw.lower()
                if lowered in ("true", "1", "yes"):
                    return True
                if lowered in ("false", "0", "no"):
                    return False
                raise ValueError(raw)
            if candidate in (int, float, str):
                return candidate(raw)
        except ValueError:
            continue
    if annotation is Any:
        return raw
    raise ConfigError(f"cannot read {raw!r} as {type_name(annotation)}")


def _candidate_types(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        # A literal inside a union (`int | Literal["auto"]`) contributes its values' types.
        args = [t for arg in typing.get_args(annotation) for t in _candidate_types(arg)]
        # Try None first, then int before float, so "3" parses as the narrower type it names.
        return sorted(set(args), key=lambda t: {type(None): 0, bool: 1, int: 2, float: 3, str: 4}.get(t, 5))
    if origin is typing.Literal:
        return sorted({type(v) for v in typing.get_args(annotation)}, key=lambda t: t is str)
    return [annotation]


def check_type(what: str, value: Any, annotation: Any) -> None:
    if annotation is Any:
        return
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(f"{what} must be one of {list(allowed)}, got {value!r}")
        return
    if origin in (typing.Union, types.UnionType):
        literals = [arg for arg in typing.get_args(annotation) if typing.get_origin(arg) is typing.Literal]
        others = [arg for arg in typing.get_args(annotation) if typing.get_origin(arg) is not typing.Literal]
        if literals and any(value in typing.get_args(literal) for literal in literals):
            return
        if literals and isinstance(value, str) and str not in others:
            raise ConfigError(f"{what} must be {type_name(annotation)}, got {value!r}")
    allowed_types = [t for t in _candidate_types(annotation) if isinstance(t, type)]
    if float in allowed_types and int not in allowed_types:
        allowed_types.append(int)
    ok = any(isinstance(value, t) and not (t is int and isinstance(value, bool) and bool not in allowed_types)
             for t in allowed_types)
    if not ok:
        raise ConfigError(f"{what} must be {type_name(annotation)}, got {value!r}")


def type_name(annotation: Any) -> str:
    if annotation is Any:
        return "any"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(repr(v) for v in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))
