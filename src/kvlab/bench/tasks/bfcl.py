"""Tool calling: Berkeley Function Calling Leaderboard single-call questions (`bfcl-eval`'s data)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.tasks.base import Sample, Task, data_file, read_jsonl, tasks
from kvlab.errors import ConfigError

CATEGORIES = ("simple_python", "multiple", "live_simple", "live_multiple")
_STRING_NOISE = re.compile(r"[ ,./\-_*^'\"]")


@tasks.register("bfcl")
@dataclasses.dataclass
class BFCLTask(Task):
    """BFCL v4 single-call categories: given function schemas and a request, emit one call; exact match.

    `call_exact` is 1 when the function name is exactly the expected one and every argument matches
    BFCL's possible answers: a given argument equals one of the allowed values (strings compared as
    BFCL does, lower case without spaces and punctuation; an int accepted for a float), an omitted one
    is optional (its allowed values include ""), and no unexpected argument is passed. The call is read
    from the first line that parses as a Python call. Deviation: BFCL's full checker also type-checks
    against the schema and handles parallel calls; these categories have exactly one expected call.
    """

    category: ClassVar[str] = "tool calling"
    primary_metric: ClassVar[str] = "call_exact"
    scorer: ClassVar[str] = "BFCL AST match of the call (kvlab's parser)"
    data_package: ClassVar[str | None] = "bfcl_eval"
    default_max_new_tokens: ClassVar[int] = 48
    # No stop string: small models often open a code fence or a blank line before the call.

    subset: str = dataclasses.field(
        default="simple_python", metadata={"help": "BFCL category: " + ", ".join(CATEGORIES)}
    )
    data_path: str | None = dataclasses.field(default=None, metadata={"help": "questions JSONL (answers beside it)"})
    answer_path: str | None = dataclasses.field(default=None, metadata={"help": "possible-answer JSONL"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.subset not in CATEGORIES:
            raise ConfigError(f"unknown BFCL subset {self.subset!r}; choose one of: {', '.join(CATEGORIES)}")

    def rows(self) -> Iterable[Any]:
        filename = f"BFCL_v4_{self.subset}.json"
        questions = data_file("bfcl_eval", "data", filename, override=self.data_path)
        answers = data_file("bfcl_eval", "data", "possible_answer", filename, override=self.answer_path)
        return _joined(read_jsonl(questions), read_jsonl(answers))

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        question, answer = row
        turns = question["question"][0]
        request = next(turn["content"] for turn in turns if turn["role"] == "user")
        (expected,) = answer["ground_truth"]
        ((name, arguments),) = expected.items()
        if not isinstance(arguments, dict):
            raise TypeError("expected arguments must be an object")
        functions = json.dumps(question["function"], ensure_ascii=False)
        prompt = (
            f"You can call these functions:\n{functions}\n\nRequest: {request}\n\n"
            "Reply with exactly one function call in Python syntax, like name(argument=value), and nothing else."
        )
        return Sample(id=str(question["id"]), prompt=prompt, references=(name,), extra={"arguments": arguments})

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        call = parse_call(prediction)
        if call is None:
            return {"call_exact": 0.0, "name_match": 0.0}
        name, arguments = call
        name_match = name == sample.references[0]
        exact = name_match and arguments_match(arguments, sample.extra["arguments"])
        return {"call_exact": float(exact), "name_match": float(name_match)}


def parse_call(text: str) -> tuple[str, dict[str, Any]] | None:
    """(dotted function name, keyword arguments) of the first line that is one Python call."""
    for line in text.replace("`", "\n").splitlines():
        line = line.strip().removeprefix("python").strip()
        try:
            node = ast.parse(line, mode="eval").body
        except SyntaxError:
            continue
        if isinstance(node, ast.List) and len(node.elts) == 1:
            node = node.elts[0]
        if not isinstance(node, ast.Call) or node.args:
            continue
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            return ast.unparse(node.func), arguments
        except (ValueError, SyntaxError, TypeError):
            continue
    return None


def arguments_match(arguments: dict[str, Any], allowed: dict[str, list[Any]]) -> bool:
    """Every given argument takes an allowed value, every omitted one is optional, none is extra."""
    if set(arguments) - set(allowed):
        return False
    for key, values in allowed.items():
        if key not in arguments:
            if "" not in values:
                return False
        elif not any(_values_equal(arguments[key], value) for value in values):
            return False
    return True


def _values_equal(given: Any, expected: Any) -> bool:
    if isinstance(expected, str) and isinstance(given, str):
        return _STRING_NOISE.sub("", given.lower()) == _STRING_NOISE.sub("", expected.lower())
    if isinstance(expected, bool) or isinstance(given, bool):
        return given is expected
    if isinstance(expected, (int, float)) and isinstance(given, (int, float)):
        return float(given) == float(expected)
    if isinstance(expected, list) and isinstance(given, (list, tuple)):
        return len(given) == len(expected) and all(_values_equal(g, e) for g, e in zip(given, expected, strict=True))
    if isinstance(expected, dict) and isinstance(given, dict):
        return given.keys() == expected.keys() and all(
            any(_values_equal(given[k], option) for option in (v if isinstance(v, list) else [v]))
            for k, v in expected.items()
        )
    return bool(given == expected)


def _joined(questions: Iterator[Any], answers: Iterator[Any]) -> Iterator[Any]:
    """(question, answer) pairs matched by id; a row without its partner yields None (malformed)."""
    by_id = {row["id"]: row for row in answers if isinstance(row, dict) and "id" in row}
    for question in questions:
        answer = by_id.get(question.get("id")) if isinstance(question, dict) else None
        yield (question, answer) if answer is not None else None
