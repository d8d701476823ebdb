"""Quality and fidelity metrics: hand-made cases, LongBench normalization, and `rouge-score` as the oracle."""

from __future__ import annotations

import itertools
import random

import pytest
from rouge_score import rouge_scorer

from kvlab.bench.metrics import (
    best_over_references,
    exact_match,
    f1_score,
    first_divergence,
    lcs_length,
    matched_prefix_fraction,
    normalize_answer,
    output_exact_match,
    rouge_l,
    string_match_all,
)
from kvlab.bench.tasks.base import package_dir, read_jsonl
from kvlab.bench.tasks.summarization import PACKAGE


def test_normalization_drops_case_punctuation_articles_and_extra_spaces() -> None:
    assert normalize_answer("  The Eiffel-Tower, in   PARIS!  ") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("Paris", "paris.", 1.0),
        ("the Paris", "Paris", 1.0),
        ("Paris, France", "Paris", 0.0),
        ("", "Paris", 0.0),
    ],
)
def test_exact_match(prediction: str, reference: str, expected: float) -> None:
    assert exact_match(prediction, reference) == expected


@pytest.mark.parametrize(
    ("prediction", "reference", "expected"),
    [
        ("Paris", "Paris", 1.0),
        ("in Paris France", "Paris", 2 * (1 / 3) * 1 / (1 / 3 + 1)),  # precision 1/3, recall 1
        ("the cat sat", "a cat sat down", 2 * 1.0 * (2 / 3) / (1.0 + 2 / 3)),  # articles dropped on both sides
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("a the an", "Paris", 0.0),  # nothing left after normalization
    ],
)
def test_f1_score_hand_cases(prediction: str, reference: str, expected: float) -> None:
    assert f1_score(prediction, reference) == pytest.approx(expected)


def test_f1_counts_repeated_tokens_once_per_match() -> None:
    assert f1_score("yes yes yes", "yes") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))


def test_best_over_references_takes_the_maximum() -> None:
    assert best_over_references(exact_match, "France", ["Italy", "france"]) == 1.0
    assert best_over_references(f1_score, "France", []) == 0.0


def test_lcs_length_is_symmetric_and_correct() -> None:
    assert lcs_length("ABCBDAB", "BDCABA") == 4
    assert lcs_length("BDCABA", "ABCBDAB") == 4
    assert lcs_length([], [1, 2]) == 0


def _oracle(prediction: str, reference: str) -> float:
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    return float(scorer.score(reference, prediction)["rougeL"].fmeasure)


@pytest.mark.parametrize(
    ("prediction", "reference"),
    [
        ("the cat sat on the mat", "the cat was on the mat"),
        ("Police arrested 3 men in Leeds!", "Three men were arrested by police in Leeds."),
        ("completely different", "nothing shared here"),
        ("", "empty prediction"),
        ("punctuation... only?!", "punctuation only"),
        ("Café au lait, 42%", "cafe au lait 42"),
    ],
)
def test_rouge_l_agrees_with_rouge_score_on_hand_cases(prediction: str, reference: str) -> None:
    assert rouge_l(prediction, reference) == pytest.approx(_oracle(prediction, reference), abs=1e-12)


def test_rouge_l_agrees_with_rouge_score_on_random_token_strings() -> None:
    rng = random.Random(0)
    vocabulary = ["a", "b", "c", "d", "e", "x1", "y2", "The", "of,", "in."]
    for _ in range(200):
        prediction = " ".join(rng.choices(vocabulary, k=rng.randint(0, 12)))
        reference = " ".join(rng.choices(vocabulary, k=rng.randint(1, 12)))
        assert rouge_l(prediction, reference) == pytest.approx(_oracle(prediction, reference), abs=1e-12), (
            prediction,
            reference,
        )


def test_rouge_l_agrees_with_rouge_score_on_real_summaries() -> None:
    path = package_dir(PACKAGE) / "data" / "XSum" / "test.jsonl"
    rows = [row for _, row in zip(range(12), read_jsonl(path), strict=False)]
    # Each summary scored against the next article's first sentence: partial, non-trivial overlaps.
    for row, other in itertools.pairwise(rows):
        prediction = other["document"].split("\n")[0]
        assert rouge_l(prediction, row["summary"]) == pytest.approx(_oracle(prediction, row["summary"]), abs=1e-12)


def test_every_metric_stays_in_the_unit_interval() -> None:
    rng = random.Random(1)
    words = ["alpha", "beta", "the", "gamma", "Delta!", "7"]
    for _ in range(100):
        prediction = " ".join(rng.choices(words, k=rng.randint(0, 8)))
        reference = " ".join(rng.choices(words, k=rng.randint(1, 8)))
        for metric in (exact_match, f1_score, rouge_l):
            assert 0.0 <= metric(prediction, reference) <= 1.0, (metric.__name__, prediction, reference)


def test_string_match_all_is_the_share_of_references_found() -> None:
    assert string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("VAR abcde", ["ABCDE"]) == 1.0
    assert string_match_all("anything", []) == 0.0


@pytest.mark.parametrize(
    ("ours", "full", "divergence"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 4], [1, 2, 3], 2),
        ([9, 2, 3], [1, 2, 3], 0),
        ([1, 2], [1, 2, 3], 2),  # stopped early
        ([1, 2, 3, 4], [1, 2, 3], 3),  # went on
        ([], [], None),
    ],
)
def test_first_divergence(ours: list[int], full: list[int], divergence: int | None) -> None:
    assert first_divergence(ours, full) == divergence
    assert output_exact_match(ours, full) == float(divergence is None)


def test_matched_prefix_fraction() -> None:
    assert matched_prefix_fraction([1, 2, 9, 9], [1, 2, 3, 4]) == 0.5
    assert matched_prefix_fraction([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert matched_prefix_fraction([], []) == 1.0
    assert matched_prefix_fraction([5], []) == 0.0
