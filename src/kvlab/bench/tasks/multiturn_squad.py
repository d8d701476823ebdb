"""Multi-turn shared context: several SQuAD questions about one article, asked in turn over one cache."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.tasks.base import Sample, read_json, require_str, tasks
from kvlab.bench.tasks.squad import PARAGRAPH_STRIDE, SQuADTask
from kvlab.errors import ConfigError

logger = logging.getLogger(__name__)

INSTRUCTION = "Answer each question about the document above in a few words."


@tasks.register("multiturn_squad")
@dataclasses.dataclass
class MultiTurnSQuADTask(SQuADTask):
    """`num_turns` questions about one SQuAD article, each turn seeing the earlier questions and answers.

    The document is built as `squad` builds it (the article's paragraphs around a starting one, up to
    `context_tokens`); the questions come from different paragraphs of that document, from the
    starting one outward (then second questions of the same paragraphs when the document is short).
    Turn k's prompt is the document, an instruction, questions 1..k-1 with their
    reference answers (as SCBench's multi-turn mode feeds the golden answers), then question k. The
    runner compresses the document once, at turn 1, and reuses it (see `kvlab.bench.multiturn`).

    Samples are turns: `num_samples` turns are loaded, conversation after conversation, so ask for a
    multiple of `num_turns`. Scores: LongBench's F1 and SQuAD's exact match, per turn in the report.
    """

    category: ClassVar[str] = "multi-turn QA"
    shared_context: ClassVar[bool] = True

    num_turns: int = dataclasses.field(default=4, metadata={"help": "questions per document, asked in turn"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.num_turns <= 8:
            raise ConfigError(f"num_turns must be between 2 and 8, got {self.num_turns}")

    def rows(self) -> Iterable[Any]:
        data = read_json(self.data_path_resolved())
        articles = data.get("data", []) if isinstance(data, dict) else []
        return _articles_with_start(articles)

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        return self.build_samples(index, row, tokenizer)[0]

    def build_samples(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
        """The turns of one article's conversation; too few answerable paragraphs make it malformed."""
        article, start = row
        paragraphs = list(article["paragraphs"])
        texts = [require_str(p, "context") for p in paragraphs]
        kept = self._around(tokenizer, texts, start)
        low = start - kept.index(texts[start])
        order = sorted(range(low, low + len(kept)), key=lambda i: (abs(i - start), i))
        questions = _spread_questions([_answerable(paragraphs[i]) for i in order])
        if len(questions) < self.num_turns:
            raise ValueError(f"{len(questions)} answerable questions in the document, {self.num_turns} turns wanted")
        document = f"{article.get('title', '').replace('_', ' ')}\n" + "\n\n".join(kept)
        turns: list[Sample] = []
        history = ""
        for turn, qa in enumerate(questions[: self.num_turns], start=1):
            question = require_str(qa, "question")
            answers = tuple(dict.fromkeys(require_str(a, "text") for a in qa["answers"]))
            prompt = f"{document}\n\n{INSTRUCTION}\n\n{history}Question: {question}"
            extra = {"document": str(index), "turn": turn}
            turns.append(Sample(f"{index}-turn{turn}", prompt, answers, answer_prefix="Answer:", extra=extra))
            history += f"Question: {question}\nAnswer: {answers[0]}\n\n"
        return turns


def _answerable(paragraph: Any) -> list[Any]:
    return [qa for qa in paragraph.get("qas", []) if not qa.get("is_impossible", False) and qa.get("answers")]


def _spread_questions(per_paragraph: list[list[Any]]) -> list[Any]:
    """The first question of each paragraph (in the given order), then the second of each, and so on."""
    rounds = max((len(qas) for qas in per_paragraph), default=0)
    return [qas[n] for n in range(rounds) for qas in per_paragraph if n < len(qas)]


def _articles_with_start(articles: list[Any]) -> Iterator[Any]:
    """(article, starting paragraph) rows, the start spread as `squad` spreads it."""
    for number, article in enumerate(articles):
        try:
            yield article, (number * PARAGRAPH_STRIDE) % len(article["paragraphs"])
        except (KeyError, TypeError, ZeroDivisionError):
            yield None
