"""The registry: typed creation from dicts and CLI strings, clear errors, listing."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from kvlab.errors import ConfigError
from kvlab.registry import Registry, to_dict

widgets: Registry[object] = Registry("test-widget")


@widgets.register("knob")
@dataclasses.dataclass
class KnobWidget:
    """A knob with a few settings."""

    bits: int = 4
    ratio: float | None = None
    mode: Literal["fast", "exact"] = "fast"
    enabled: bool = True
    label: str = dataclasses.field(default="k", metadata={"help": "shown name"})

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8):
            raise ValueError(f"bits must be one of 2, 4, 8, got {self.bits}")


def test_create_from_strings_parses_each_field_by_type() -> None:
    knob = widgets.create_from_strings("knob", ["bits=8", "ratio=0.5", "mode=exact", "enabled=false", "label=x"])
    assert knob == KnobWidget(bits=8, ratio=0.5, mode="exact", enabled=False, label="x")
    assert widgets.create_from_strings("knob", ["ratio=none"]).ratio is None  # type: ignore[attr-defined]


def test_round_trip_through_dict() -> None:
    knob = widgets.create("knob", bits=2, ratio=0.25)
    spec = to_dict(knob)
    assert spec == {"name": "knob", "bits": 2, "ratio": 0.25, "mode": "fast", "enabled": True, "label": "k"}
    assert widgets.from_dict(spec) == knob


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: widgets.get("dial"), "unknown test-widget 'dial'; choose one of: knob"),
        (lambda: widgets.create("knob", colour="red"), "has no parameter 'colour'; parameters: bits, ratio"),
        (lambda: widgets.create("knob", bits="4"), "parameter 'bits' must be int"),
        (lambda: widgets.create("knob", mode="slow"), "must be one of \\['fast', 'exact'\\]"),
        (lambda: widgets.create("knob", bits=3), "bits must be one of 2, 4, 8"),
        (lambda: widgets.create_from_strings("knob", ["bits"]), "expected key=value"),
        (lambda: widgets.create_from_strings("knob", ["bits=four"]), "cannot read 'four' as int"),
        (lambda: widgets.from_dict({"bits": 4}), "needs a 'name' key"),
    ],
)
def test_mistakes_raise_config_errors_that_name_the_allowed_values(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message):
        call()


def test_describe_lists_parameters_with_defaults_and_help() -> None:
    (row,) = widgets.describe()
    assert row["name"] == "knob" and row["summary"] == "A knob with a few settings."
    label = next(p for p in row["parameters"] if p["name"] == "label")
    assert label == {"name": "label", "type": "str", "default": "k", "help": "shown name"}


def test_a_float_field_accepts_an_int() -> None:
    assert widgets.create("knob", ratio=1).ratio == 1  # type: ignore[attr-defined]
