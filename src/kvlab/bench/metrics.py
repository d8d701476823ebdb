"""Quality and fidelity metrics: pure functions of strings or token ids, every score in [0, 1].

Answer normalization follows LongBench (`normalize_answer`: lower case, no punctuation, no articles,
single spaces), which itself follows the SQuAD evaluation script. `rouge_l` tokenizes as the
`rouge-score` package does by default (lower case, runs of characters other than a-z and 0-9 split
tokens, no stemming) and returns the LCS F-measure, so its values equal
`RougeScorer(["rougeL"]).score(reference, prediction)["rougeL"].fmeasure`; it is the convention for
XSum and Multi-LexSum. LongBench's datasets are scored with LongBench's own metrics instead
(`longbench_score`, in `kvlab.bench.longbench_metrics`), whose ROUGE-L differs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from kvlab.bench.longbench_metrics import longbench_score, normalize_answer, qa_f1_score

__all__ = [
    "best_over_references",
    "exact_match",
    "f1_score",
    "first_divergence",
    "lcs_length",
    "longbench_score",
    "matched_prefix_fraction",
    "normalize_answer",
    "output_exact_match",
    "rouge_l",
    "rouge_tokens",
    "string_match_all",
]

_ROUGE_SPLIT = re.compile(r"[^a-z0-9]+")

Metric = Callable[[str, str], float]


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when both normalize to the same string, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1_score(prediction: str, reference: str) -> float:
    """Token F1 of the normalized strings (LongBench `qa_f1_score`); 0.0 when either side is empty."""
    return qa_f1_score(prediction, reference)


def rouge_tokens(text: str) -> list[str]:
    """Tokens as `rouge-score`'s default tokenizer makes them (no stemming)."""
    return [token for token in _ROUGE_SPLIT.split(text.lower()) if token]


def lcs_length(first: Sequence[object], second: Sequence[object]) -> int:
    """Length of the longest common subsequence (dynamic programming, one row of memory)."""
    if len(second) > len(first):
        first, second = second, first
    row = [0] * (len(second) + 1)
    for item in first:
        previous_diagonal = 0
        for j, other in enumerate(second, start=1):
            above = row[j]
            row[j] = previous_diagonal + 1 if item == other else max(row[j], row[j - 1])
            previous_diagonal = above
    return row[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (LCS of tokens); 0.0 when either side has no tokens."""
    predicted, expected = rouge_tokens(prediction), rouge_tokens(reference)
    if not predicted or not expected:
        return 0.0
    common = lcs_length(predicted, expected)
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def best_over_references(metric: Metric, prediction: str, references: Sequence[str]) -> float:
    """The highest score of `prediction` against any reference (0.0 when there are none)."""
    return max((metric(prediction, reference) for reference in references), default=0.0)


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's `string_match_all`: the fraction of references found in the prediction, case-insensitive."""
    if not references:
        return 0.0
    lowered = prediction.lower()
    return sum(reference.lower() in lowered for reference in references) / len(references)


def first_divergence(token_ids: Sequence[int], reference_ids: Sequence[int]) -> int | None:
    """Index of the first position where two outputs differ, or None when they are identical.

    A strict prefix diverges at the shorter one's length (one output stopped, the other went on).
    """
    for index, (token, reference) in enumerate(zip(token_ids, reference_ids, strict=False)):
        if token != reference:
            return index
    if len(token_ids) != len(reference_ids):
        return min(len(token_ids), len(reference_ids))
    return None


def output_exact_match(token_ids: Sequence[int], reference_ids: Sequence[int]) -> float:
    """Fidelity: 1.0 when the whole output equals the full-KV output token for token, else 0.0."""
    return float(first_divergence(token_ids, reference_ids) is None)


def matched_prefix_fraction(token_ids: Sequence[int], reference_ids: Sequence[int]) -> float:
    """Fidelity: the share of the full-KV output reproduced before the first divergence."""
    if not reference_ids:
        return float(not token_ids)
    divergence = first_divergence(token_ids, reference_ids)
    return 1.0 if divergence is None else divergence / len(reference_ids)
