"""Multi-document QA: HotpotQA questions over RULER-style packed Wikipedia paragraphs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.metrics import best_over_references, exact_match, f1_score
from kvlab.bench.tasks.base import Sample, read_json, require_str, tasks
from kvlab.bench.tasks.ruler import RulerQATask


@tasks.register("hotpotqa")
@dataclasses.dataclass
class HotpotQATask(RulerQATask):
    """HotpotQA (multi-document QA) from RULER's packaged `hotpotqa.json`; scored by F1.

    Each prompt holds the two supporting paragraphs, then the row's own distractor paragraphs, then
    paragraphs of other questions drawn at random, until `context_tokens`; the documents are shuffled.
    LongBench's HotpotQA is built the same way from the same source, at longer contexts.
    """

    category: ClassVar[str] = "multi-doc QA"
    scorer: ClassVar[str] = "LongBench qa_f1_score (F1); SQuAD exact match"
    data_filename: ClassVar[str] = "hotpotqa.json"

    def rows(self) -> Iterable[Any]:
        data = read_json(self.data_path_resolved())
        return data if isinstance(data, list) else []

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        question, answer = require_str(row, "question"), require_str(row, "answer")
        supporting = {title for title, _ in row["supporting_facts"]}
        documents = [(title, f"{title}\n{''.join(sentences)}") for title, sentences in row["context"]]
        gold = [doc for title, doc in documents if title in supporting]
        if not gold:
            raise ValueError("no supporting paragraph in the row's context")
        distractors = [doc for title, doc in documents if title not in supporting]
        rng = self.rng(index)
        packed = self.pack_documents(tokenizer, gold, distractors + self._random_documents(rng, index))
        rng.shuffle(packed)
        prompt, prefix = self.qa_sample_text(question, packed)
        return Sample(id=str(row.get("_id", index)), prompt=prompt, references=(answer,), answer_prefix=prefix)

    def _random_documents(self, rng: Any, index: int, count: int = 64) -> list[str]:
        rows = list(self.rows())
        picked = []
        for other in rng.sample(range(len(rows)), min(count, len(rows))):
            if other == index:
                continue
            try:
                title, sentences = rng.choice(rows[other]["context"])
                picked.append(f"{title}\n{''.join(sentences)}")
            except (KeyError, IndexError, TypeError, ValueError):
                continue
        return picked

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {
            "f1": best_over_references(f1_score, prediction, sample.references),
            "exact_match": best_over_references(exact_match, prediction, sample.references),
        }
