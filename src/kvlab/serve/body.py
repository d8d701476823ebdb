"""A request body parsed within fixed bounds, before any model or tokenizer sees it.

`parse_body` takes UTF-8 JSON of at most `MAX_BODY_BYTES`, an object nested at most `MAX_JSON_DEPTH`
deep with at most `MAX_JSON_VALUES` values, integers of at most `MAX_INT_DIGITS` digits, finite
numbers only, and strings that are text (no lone UTF-16 surrogate, which no tokenizer, log or reply
can encode). The request models of `kvlab.serve.protocol` then validate the fields.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

MAX_BODY_BYTES = 16 << 20
# The deepest valid body nests 5 levels (body > messages > message > content > part).
MAX_JSON_DEPTH = 32
# Every 64-bit integer fits (2**64 has 20 digits); longer ones cost quadratic time to convert.
MAX_INT_DIGITS = 20
# Array elements and object members in all (a prompt of token ids is one value per token).
MAX_JSON_VALUES = 1 << 20
JSON_MEDIA_TYPE = "application/json"
# Characters of a member name quoted in an error message.
MAX_QUOTED_CHARS = 64


class BodyError(ValueError):
    """A request body outside the parser's bounds, or not a JSON object (HTTP 400)."""


class _Refused:
    """What the parser's hooks put in place of a number it refuses; `parse_body` then says where."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _NumberHooks:
    """`json.loads` hooks that stand refused numbers in for `_Refused` markers, and count them."""

    def __init__(self) -> None:
        self.num_refused = 0

    def integer(self, text: str) -> int | _Refused:
        digits = len(text.lstrip("-"))
        return int(text) if digits <= MAX_INT_DIGITS else self._refuse(
            f"integers are limited to {MAX_INT_DIGITS} digits, got one of {digits}")

    def real(self, text: str) -> float | _Refused:
        value = float(text)
        return value if math.isfinite(value) else self._refuse(f"{text[:32]} is out of the range of a double")

    def constant(self, text: str) -> _Refused:
        return self._refuse(f"{text} is not a JSON number")

    def _refuse(self, reason: str) -> _Refused:
        self.num_refused += 1
        return _Refused(reason)


# A JSON string with its escapes (the unrolled form: linear, at C speed, on a long prompt).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_ONE_BRACKET = bytes.maketrans(b"{}", b"[]")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, within the bounds above.

    Its depth and size are measured on its brackets and commas before anything is built; numbers are
    checked as they are parsed, strings once parsed, and the first value refused is reported with
    where it is.

    Raises:
        BodyError: Not UTF-8 JSON, not an object, nested deeper than `MAX_JSON_DEPTH`, holding more
            than `MAX_JSON_VALUES` values, a number the bounds refuse (`kvlab.drafter_args.seed: ...`)
            or a string with a lone surrogate (`messages.0.content: ...`).
    """
    _check_structure(raw)
    try:
        # Strict UTF-8 (an optional byte-order mark aside): json.loads would take UTF-16 and UTF-32 too,
        # and encoded surrogates, which strict decoding refuses; escaped ones are checked below.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise BodyError(f"the body is not UTF-8: {error}") from None
    hooks = _NumberHooks()
    try:
        data = json.loads(text, parse_int=hooks.integer, parse_float=hooks.real, parse_constant=hooks.constant)
    except RecursionError:  # unbalanced brackets the structure check let through; the C scanner's guard
        raise BodyError(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:  # JSONDecodeError is a ValueError
        raise BodyError(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise BodyError("the body must be a JSON object")
    if hooks.num_refused:
        _report_refused(data)
    if _SURROGATE_ESCAPE.search(raw) is not None:  # only escapes make surrogates in a UTF-8 body
        _report_surrogates(data)
    return data


def _check_structure(raw: bytes) -> None:
    """Values (commas outside strings) and depth (brackets outside strings) of `raw`, before parsing."""
    structure = _JSON_STRING.sub(b"", raw)
    if structure.count(b",") >= MAX_JSON_VALUES:
        raise BodyError(f"the body holds more than {MAX_JSON_VALUES} JSON values")
    brackets = structure.translate(_ONE_BRACKET, _NOT_BRACKETS)
    # Each pass takes away the innermost pairs, one level (replace does not rescan what it made);
    # unbalanced brackets are left for the parser to report.
    for _ in range(MAX_JSON_DEPTH):
        if b"[]" not in brackets:
            return
        brackets = brackets.replace(b"[]", b"")
    if b"[]" in brackets:
        raise BodyError(f"the body nests deeper than {MAX_JSON_DEPTH} levels")


# A JSON escape of a surrogate, `\uD800` to `\uDFFF` (perhaps half of a valid pair: the parsed strings tell).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _members(data: dict[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """`(where, name, value)` of every member and element of `data`, where its name or index is in a
    dotted path (`messages.0.content`); walked without recursion."""
    stack: list[tuple[dict[str, Any] | list[Any], str]] = [(data, "")]
    while stack:
        container, path = stack.pop()
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in items:
            # An error message must itself be text: a name with a surrogate is quoted escaped.
            name = str(key)[:MAX_QUOTED_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
            where = f"{path}.{name}" if path else name
            yield where, key, value
            if isinstance(value, (dict, list)):
                stack.append((value, where))


def _report_refused(data: dict[str, Any]) -> None:
    """Raise for the first refused number, naming its path."""
    for where, _, value in _members(data):
        if isinstance(value, _Refused):
            raise BodyError(f"{where}: {value.reason}")
    raise AssertionError("a number was refused but is not in the body")


def _report_surrogates(data: dict[str, Any]) -> None:
    """Raise for the first name or string holding a lone surrogate (a valid pair is one character once
    parsed), naming its path."""
    for where, key, value in _members(data):
        for text in (key, value):
            if isinstance(text, str) and not text.isascii() and _SURROGATE.search(text) is not None:
                raise BodyError(
                    f"{where}: holds a lone UTF-16 surrogate (\\ud800 to \\udfff), which is not text: escape "
                    "characters past U+FFFF as a complete surrogate pair, or send them as UTF-8"
                )


def is_json_media_type(content_type: str | None) -> bool:
    """Whether a Content-Type header is `application/json`, alone or with `charset=utf-8`."""
    if content_type is None:
        return False
    media_type, *parameters = (part.strip().lower() for part in content_type.split(";"))
    if media_type != JSON_MEDIA_TYPE:
        return False
    return all(parameter.replace(" ", "") in ("charset=utf-8", 'charset="utf-8"') for parameter in parameters)
