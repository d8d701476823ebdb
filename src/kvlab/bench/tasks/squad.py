"""Single-document QA: SQuAD questions over their whole Wikipedia article (RULER's packaged SQuAD)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.metrics import best_over_references, exact_match, f1_score
from kvlab.bench.tasks.base import Sample, count_tokens, read_json, require_str, tasks
from kvlab.bench.tasks.ruler import RulerQATask

# Spreads the chosen questions over the paragraphs of each article (a fixed, deterministic stride).
PARAGRAPH_STRIDE = 7


@tasks.register("squad")
@dataclasses.dataclass
class SQuADTask(RulerQATask):
    """SQuAD 2.0 answerable questions (single-document QA) from RULER's packaged `squad.json`; F1.

    One question per article. The context is that one article: the paragraph holding the answer and
    its neighbours, in the article's order, grown outward until `context_tokens`. (RULER instead mixes
    the gold paragraph with paragraphs of other articles; LongBench's single-document sets, Qasper and
    MultiFieldQA, are one long document, which this follows.)
    """

    category: ClassVar[str] = "single-doc QA"
    scorer: ClassVar[str] = "LongBench qa_f1_score (F1); SQuAD exact match"
    data_filename: ClassVar[str] = "squad.json"

    def rows(self) -> Iterable[Any]:
        data = read_json(self.data_path_resolved())
        articles = data.get("data", []) if isinstance(data, dict) else []
        return _one_question_per_article(articles)

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        article, paragraph_index, qa = row
        paragraphs = [require_str(p, "context") for p in article["paragraphs"]]
        question = require_str(qa, "question")
        answers = tuple(dict.fromkeys(require_str(a, "text") for a in qa["answers"]))
        if not answers:
            raise ValueError("an answerable question without answers")
        kept = self._around(tokenizer, paragraphs, paragraph_index)
        document = f"{article.get('title', '').replace('_', ' ')}\n" + "\n\n".join(kept)
        prompt, prefix = self.qa_sample_text(question, [document])
        return Sample(id=str(qa.get("id", index)), prompt=prompt, references=answers, answer_prefix=prefix)

    def _around(self, tokenizer: PreTrainedTokenizerBase, paragraphs: list[str], center: int) -> list[str]:
        """Paragraph `center` and its neighbours, alternately after and before, within the budget."""
        low, high = center, center + 1
        used = count_tokens(tokenizer, paragraphs[center])
        while low > 0 or high < len(paragraphs):
            after = high < len(paragraphs) and ((high - center) <= (center - low) or low == 0)
            candidate = high if after else low - 1
            used += count_tokens(tokenizer, paragraphs[candidate]) + 2
            if used > self.context_tokens:
                break
            low, high = (low, high + 1) if after else (low - 1, high)
        return paragraphs[low:high]

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {
            "f1": best_over_references(f1_score, prediction, sample.references),
            "exact_match": best_over_references(exact_match, prediction, sample.references),
        }


def _one_question_per_article(articles: list[Any]) -> Iterator[Any]:
    """(article, paragraph index, qa) rows; a malformed article yields None so it is counted."""
    for number, article in enumerate(articles):
        try:
            paragraphs = article["paragraphs"]
            start = (number * PARAGRAPH_STRIDE) % len(paragraphs)
            order = list(range(start, len(paragraphs))) + list(range(start))
            found = next(
                (article, i, qa) for i in order for qa in paragraphs[i]["qas"] if not qa.get("is_impossible", False)
            )
        except (KeyError, TypeError, ZeroDivisionError, StopIteration, AttributeError):
            yield None
            continue
        yield found
