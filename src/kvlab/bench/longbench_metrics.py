"""LongBench's scorers (Bai et al., 2023), re-implemented from its `metrics.py` and `eval.py`.

`longbench_score(dataset, prediction, answers)` gives the score LongBench's `eval.py` gives one
prediction: the dataset's metric (`DATASET_METRICS`), the best over the reference answers, after
keeping only the first line of the prediction for the few-shot sets (`FIRST_LINE_DATASETS`).

What makes these differ from look-alike metrics, and is reproduced here on purpose:
- ROUGE-L is the `rouge` package's (pltrdy) summary-level ROUGE-L, which LongBench calls with its
  defaults: no lower-casing, punctuation stays attached to words ("Paris." is not "Paris"),
  sentences split on every ".", words split on single spaces, every count taken over *distinct*
  words (its `exclusive` mode), the union of one reconstructed LCS per pair of sentences, and
  F = 2PR / (P + R + 1e-8). A prediction or reference with no sentence scores 0.0 (the package
  raises and LongBench catches it).
- `classification_score` removes matched class names that are part of the answer while iterating
  over the same list, so the entry after each removed one is never examined.
- `code_sim_score` is fuzzywuzzy's `ratio` as LongBench installs it (no python-Levenshtein, so
  difflib's `SequenceMatcher`), rounded to a whole percent.
- The Chinese metrics segment words with jieba (`pip install jieba`, in kvlab's `bench` extra).

Deviation: the `rouge` package reconstructs each LCS recursively and fails (LongBench then scores
0.0) on a pair of sentences of more than ~1,000 words in all; here such pairs are scored.
"""

from __future__ import annotations

import collections
import difflib
import logging
import re
import string
from collections.abc import Callable, Iterable, Sequence

from kvlab.errors import ConfigError

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
# normalize_zh_answer's extra punctuation (full-width forms, CJK marks, dashes, quotes and ".").
_ZH_PUNCTUATION = _PUNCTUATION | frozenset(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_NUMBERS = re.compile(r"\d+")
# eval.py keeps only the prediction's first line for these (their answers are one line).
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})

Scorer = Callable[[str, str, Sequence[str]], float]


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD normalization: lower case, drop punctuation and articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
    """LongBench's Chinese normalization: lower case, drop (CJK) punctuation and every space."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCTUATION).split())


def token_f1(predicted: Sequence[str], expected: Sequence[str]) -> float:
    """F1 of two token lists, each token matched at most as often as it occurs on both sides."""
    overlap = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(expected)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, answer: str, all_classes: Sequence[str] = ()) -> float:
    """Token F1 of the normalized strings."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(answer).split())


def qa_f1_zh_score(prediction: str, answer: str, all_classes: Sequence[str] = ()) -> float:
    """Token F1 over jieba words, each normalized, empty ones dropped."""

    def words(text: str) -> list[str]:
        return [word for word in map(normalize_zh_answer, _jieba_words(text)) if word]

    return token_f1(words(prediction), words(answer))


def rouge_score(prediction: str, answer: str, all_classes: Sequence[str] = ()) -> float:
    """ROUGE-L F of the `rouge` package as LongBench calls it (see the module docstring)."""
    predicted, expected = _rouge_sentences(prediction), _rouge_sentences(answer)
    if not predicted or not expected:
        return 0.0
    predicted_words = {word for sentence in predicted for word in sentence}
    expected_words = {word for sentence in expected for word in sentence}
    common: set[str] = set()
    for reference in expected:
        for candidate in predicted:
            common.update(_reconstructed_lcs(reference, candidate))
    recall, precision = len(common) / len(expected_words), len(common) / len(predicted_words)
    return 2.0 * (precision * recall / (precision + recall + 1e-8))


def rouge_zh_score(prediction: str, answer: str, all_classes: Sequence[str] = ()) -> float:
    """`rouge_score` over jieba words joined by spaces."""
    return rouge_score(" ".join(_jieba_words(prediction)), " ".join(_jieba_words(answer)))


def classification_score(prediction: str, answer: str, all_classes: Sequence[str] = ()) -> float:
    """1/k when the answer is among the k class names found in the prediction, else 0.0."""
    matched = [name for name in all_classes if name in prediction]
    index = 0
    while index < len(matched):
        name = matched[index]
        if name in answer and name != answer:
            matched.remove(name)
        # Advances after a removal too, as iterating over the list LongBench mutates does.
        index += 1
    return 1.0 / len(matched) if answer in matched else 0.0


def count_score(prediction: str, answer: str, all_classes: Sequence[str] = ()) -> float:
    """The share of numbers in the prediction that equal the answer (0.0 without numbers)."""
    return _share_equal(_NUMBERS.findall(prediction), answer)


def retrieval_score(prediction: str, answer: str, all_classes: Sequence[str] = ()) -> float:
    """The share of numbers in the prediction that equal the paragraph number in "Paragraph N"."""
    return _share_equal(_NUMBERS.findall(prediction), _paragraph_number(r"Paragraph (\d+)", answer))


def retrieval_zh_score(prediction: str, answer: str, all_classes: Sequence[str] = ()) -> float:
    """`retrieval_score` for answers written "段落N"."""
    return _share_equal(_NUMBERS.findall(prediction), _paragraph_number(r"段落(\d+)", answer))


def code_sim_score(prediction: str, answer: str, all_classes: Sequence[str] = ()) -> float:
    """fuzzywuzzy's ratio / 100 between the first code line of the prediction and the answer.

    The first line without "`", "#" or "//" counts (none: the empty string).
    """
    lines = prediction.lstrip("\n").split("\n")
    line = next((text for text in lines if "`" not in text and "#" not in text and "//" not in text), "")
    if line == answer:
        return 1.0
    if not line or not answer:
        return 0.0
    # A whole percent, rounded half to even as fuzzywuzzy's int(round()) does.
    return round(100 * difflib.SequenceMatcher(None, line, answer).ratio()) / 100


# LongBench's eval.py: dataset -> metric.
DATASET_METRICS: dict[str, Scorer] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def longbench_score(dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] = ()) -> float:
    """The score LongBench's `eval.py` gives one prediction, in [0, 1] (LongBench reports 100x the mean).

    Args:
        dataset: LongBench's dataset name (`hotpotqa`, `gov_report`, ...; LongBench-E's `_e` suffix allowed).
        prediction: The model's output.
        answers: The row's `answers`; the best score over them counts (0.0 when there are none).
        all_classes: The row's `all_classes` (used by `trec` and `lsht` only).

    Raises:
        ConfigError: Unknown dataset.
    """
    name = dataset.removesuffix("_e")
    if name not in DATASET_METRICS:
        raise ConfigError(f"unknown LongBench dataset {dataset!r}; choose one of: {', '.join(DATASET_METRICS)}")
    if name in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET_METRICS[name]
    return max((float(metric(prediction, answer, all_classes)) for answer in answers), default=0.0)


def metric_name(dataset: str) -> str:
    """The name of LongBench's metric for a dataset (`qa_f1_score`, `rouge_score`, ...)."""
    return DATASET_METRICS[dataset.removesuffix("_e")].__name__


def _rouge_sentences(text: str) -> list[list[str]]:
    """Sentences as the `rouge` package makes them: split on ".", spaces collapsed, words split on " "."""
    return [" ".join(part.split()).split(" ") for part in text.split(".") if part]


def _reconstructed_lcs(reference: Sequence[str], candidate: Sequence[str]) -> set[str]:
    """Distinct words of the one LCS the `rouge` package reconstructs (its tie-breaking: prefer the candidate side)."""
    table = [[0] * (len(candidate) + 1) for _ in range(len(reference) + 1)]
    for i, word in enumerate(reference, start=1):
        for j, other in enumerate(candidate, start=1):
            table[i][j] = table[i - 1][j - 1] + 1 if word == other else max(table[i - 1][j], table[i][j - 1])
    words: set[str] = set()
    i, j = len(reference), len(candidate)
    while i and j:
        if reference[i - 1] == candidate[j - 1]:
            words.add(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _share_equal(numbers: Sequence[str], target: str) -> float:
    return sum(number == str(target) for number in numbers) / len(numbers) if numbers else 0.0


def _paragraph_number(pattern: str, answer: str) -> str:
    match = re.search(pattern, answer)
    if match is None:
        raise ValueError(f"a passage-retrieval answer names its paragraph as {pattern!r}, got {answer!r}")
    return match.group(1)


def _jieba_words(text: str) -> Iterable[str]:
    try:
        import jieba
    except ImportError:
        raise ConfigError("LongBench's Chinese metrics need jieba: pip install jieba (or 'kvlab[bench]')") from None
    # jieba logs its dictionary loading to stderr at INFO; the library stays quiet.
    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text, cut_all=False))
