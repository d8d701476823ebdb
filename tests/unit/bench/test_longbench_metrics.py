"""LongBench's scorers: golden values worked out by hand from LongBench's metrics.py and eval.py.

Each expected value is derived in the comment beside it. ROUGE-L here is the `rouge` package's
(distinct words, sentences split on ".", F = 2PR / (P + R + 1e-8)), so a perfect match is
2 / (2 + 1e-8), not 1.0.
"""

from __future__ import annotations

import pytest

from kvlab.bench.longbench_metrics import (
    DATASET_METRICS,
    classification_score,
    code_sim_score,
    count_score,
    metric_name,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
)
from kvlab.bench.metrics import longbench_score
from kvlab.errors import ConfigError


def _f(precision: float, recall: float) -> float:
    """The `rouge` package's F formula."""
    return 2.0 * (precision * recall / (precision + recall + 1e-8))


PERFECT = _f(1.0, 1.0)  # 0.999999995


@pytest.mark.parametrize(
    ("prediction", "answer", "expected"),
    [
        ("Paris", "Paris", PERFECT),
        ("paris.", "Paris", 0.0),  # no lower-casing: "paris" and "Paris" are different words
        ("Paris, France", "Paris France", _f(1 / 2, 1 / 2)),  # "Paris," keeps its comma: only "France" matches
        ("the cat the cat", "the cat", PERFECT),  # distinct words: {the, cat} on both sides
        ("A b. C d", "C d. A b", PERFECT),  # per-sentence LCS union: {C, d} and {A, b}
        ("a b c", "a x", _f(1 / 3, 1 / 2)),  # LCS {a}; 3 distinct predicted words, 2 reference words
        ("", "Paris", 0.0),  # no sentence: the package raises, LongBench scores 0
        ("...", "Paris", 0.0),
        ("Paris", "", 0.0),
    ],
)
def test_rouge_score_golden(prediction: str, answer: str, expected: float) -> None:
    assert rouge_score(prediction, answer) == pytest.approx(expected, abs=1e-12)


def test_rouge_score_disagrees_with_rouge_score_package_where_the_issue_found_it() -> None:
    # rouge-score lower-cases and strips punctuation (1.0); LongBench's ROUGE-L does neither.
    assert longbench_score("gov_report", "paris.", ["Paris"]) == 0.0


@pytest.mark.parametrize(
    ("dataset", "prediction", "answers", "expected"),
    [
        ("hotpotqa", "paris.", ["Paris"], 1.0),  # qa_f1_score normalizes case and punctuation
        ("hotpotqa", "The Eiffel Tower", ["eiffel tower", "Paris"], 1.0),  # best answer; articles dropped
        ("hotpotqa", "\nParis\nLondon", ["London"], 2 * (1 / 2) / (1 / 2 + 1)),  # all lines: P 1/2, R 1
        ("triviaqa", "\nParis\nLondon", ["London"], 0.0),  # first line only: "Paris"
        ("triviaqa", "\nLondon\nParis", ["London"], 1.0),
        ("samsum", "Paris\nmore text", ["Paris"], PERFECT),  # first line, then ROUGE-L
        ("hotpotqa", "", ["Paris"], 0.0),
        ("hotpotqa", "Paris", [], 0.0),  # no answers: nothing to match
        ("2wikimqa_e", "Paris", ["Paris"], 1.0),  # LongBench-E names
    ],
)
def test_longbench_score_golden(dataset: str, prediction: str, answers: list[str], expected: float) -> None:
    assert longbench_score(dataset, prediction, answers) == pytest.approx(expected, abs=1e-12)


def test_qa_f1_zh_segments_with_jieba_and_drops_punctuation() -> None:
    # jieba: 北京 / 是 / 中国 / 的 / 首都 against 北京: precision 1/5, recall 1, F1 1/3.
    assert qa_f1_zh_score("北京是中国的首都", "北京") == pytest.approx(1 / 3)
    # "。" normalizes to an empty word and is dropped.
    assert qa_f1_zh_score("北京。", "北京") == 1.0
    assert longbench_score("multifieldqa_zh", "", ["北京"]) == 0.0


def test_rouge_zh_scores_jieba_words() -> None:
    # 我 / 爱 / 北京 / 天安门 against 我 / 爱 / 北京: LCS 3 words, P 3/4, R 1.
    assert rouge_zh_score("我爱北京天安门", "我爱北京") == pytest.approx(_f(3 / 4, 1.0), abs=1e-12)


@pytest.mark.parametrize(
    ("prediction", "answer", "classes", "expected"),
    [
        ("Type: city", "city", ["city", "state"], 1.0),
        ("city or state", "city", ["city", "state"], 1 / 2),  # two classes named: 1/k
        ("city", "other city", ["city", "other city"], 0.0),  # "city" is part of the answer: removed
        # LongBench removes while iterating: after removing "a", "b" is skipped, so it stays and
        # the answer shares the credit (a loop that examined every entry would give 1.0).
        ("a b", "a b", ["a", "b", "a b"], 1 / 2),
        ("nothing", "city", ["city"], 0.0),
    ],
)
def test_classification_score_golden(prediction: str, answer: str, classes: list[str], expected: float) -> None:
    assert classification_score(prediction, answer, classes) == pytest.approx(expected)
    assert longbench_score("trec", prediction, [answer], classes) == pytest.approx(expected)


def test_count_and_retrieval_score_the_share_of_right_numbers() -> None:
    assert count_score("There are 3 paragraphs, not 4, so 3", "3") == pytest.approx(2 / 3)
    assert count_score("no numbers", "3") == 0.0
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 1 or Paragraph 12", "Paragraph 12") == 1 / 2
    assert retrieval_zh_score("段落3", "段落3") == 1.0


def test_retrieval_answer_without_a_paragraph_number_is_malformed() -> None:
    with pytest.raises(ValueError, match="Paragraph"):
        retrieval_score("1", "the first one")


@pytest.mark.parametrize(
    ("prediction", "answer", "expected"),
    [
        ("```python\n# the next line\nx = foo(1)\n```", "x = foo(1)", 1.0),  # first line without ` # //
        ("x = foo(2)", "x = foo(1)", 0.9),  # difflib: 9 of 10 characters match, 2*9/20
        ("abc", "abd", 0.67),  # 2*2/6 = 66.7%, rounded to a whole percent
        ("# only a comment", "x", 0.0),  # no code line: the empty string
        ("# only a comment", "", 1.0),  # fuzzywuzzy: equal strings score 100 before the empty check
    ],
)
def test_code_sim_score_golden(prediction: str, answer: str, expected: float) -> None:
    assert code_sim_score(prediction, answer) == pytest.approx(expected)


def test_every_longbench_dataset_has_its_eval_py_metric() -> None:
    assert len(DATASET_METRICS) == 21
    assert metric_name("gov_report") == "rouge_score"
    assert metric_name("lsht") == "classification_score"
    assert metric_name("repobench-p") == "code_sim_score"


def test_unknown_dataset_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="hotpotqa"):
        longbench_score("hotpot", "x", ["x"])
