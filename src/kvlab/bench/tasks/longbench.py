"""LongBench (Bai et al., 2023): a loader for the official JSON-lines files, for users who have them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.metrics import longbench_score
from kvlab.bench.tasks.base import Sample, Task, read_jsonl, require_str, tasks
from kvlab.errors import ConfigError

_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. "
    "Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER = (
    "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
    "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
    'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or '
    '"unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on '
    "the above article as concisely as you can, using a single phrase or sentence if possible. If the question "
    'cannot be answered based on the information in the article, write "unanswerable". If the question is a '
    'yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
    "Question: {input}\n\nAnswer:"
)
_MULTIFIELDQA = (
    "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on "
    "the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
# "asconcisely" is LongBench's own spelling; kept so prompts match the published ones.
_NARRATIVEQA = (
    "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
    "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
    "Story: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single "
    "phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
)
_TRIVIAQA = (
    "Answer the question based on the given passage. Only give me the answer and do not output any other "
    "words. The following are some examples.\n\n{context}\n\n{input}"
)
_GOV_REPORT = (
    "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
    "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
)
_MULTI_NEWS = (
    "You are given several news articles. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
    "Now, write a one-page summary of all the news.\n\nSummary:"
)
# LongBench's dataset2prompt / dataset2maxlen for the datasets of the benchmark paper (the metric
# of each is LongBench's own, in `kvlab.bench.longbench_metrics`).
DATASETS: dict[str, tuple[str, int]] = {
    "hotpotqa": (_QA_PASSAGES, 32),
    "2wikimqa": (_QA_PASSAGES, 32),
    "musique": (_QA_PASSAGES, 32),
    "qasper": (_QASPER, 128),
    "multifieldqa_en": (_MULTIFIELDQA, 64),
    "narrativeqa": (_NARRATIVEQA, 128),
    "triviaqa": (_TRIVIAQA, 32),
    "gov_report": (_GOV_REPORT, 512),
    "multi_news": (_MULTI_NEWS, 512),
}
CATEGORIES = {"hotpotqa": "multi-doc QA", "2wikimqa": "multi-doc QA", "musique": "multi-doc QA",
              "qasper": "single-doc QA", "multifieldqa_en": "single-doc QA", "narrativeqa": "single-doc QA",
              "triviaqa": "few-shot", "gov_report": "summarization", "multi_news": "summarization"}  # fmt: skip


@tasks.register("longbench")
@dataclasses.dataclass
class LongBenchTask(Task):
    """One LongBench dataset from its official JSONL (`input`, `context`, `answers`, `_id`, ...).

    Prompt template, generation length and metric are LongBench's for that dataset (`DATASETS`);
    the context is cut in the middle to `context_tokens`, as LongBench's `pred.py` does. The score is
    LongBench's own (`kvlab.bench.metrics.longbench_score`: its F1, its ROUGE-L, first line only for
    the few-shot sets), reported under `score` whatever the dataset's metric.
    """

    category: ClassVar[str] = "long-context"
    primary_metric: ClassVar[str] = "score"
    scorer: ClassVar[str] = "LongBench metrics.py, the dataset's metric in eval.py"

    path: str = dataclasses.field(default="", metadata={"help": "LongBench JSONL file, e.g. data/hotpotqa.jsonl"})
    dataset: str = dataclasses.field(default="", metadata={"help": "dataset name (default: the file name)"})
    context_tokens: int = dataclasses.field(default=8192, metadata={"help": "context tokens kept (middle cut)"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path:
            raise ConfigError("longbench needs path=<file.jsonl> (LongBench's data is not shipped in a package)")
        if self.dataset_name not in DATASETS:
            raise ConfigError(f"unknown LongBench dataset {self.dataset_name!r}; choose one of: {', '.join(DATASETS)}")

    @property
    def dataset_name(self) -> str:
        return self.dataset or Path(self.path).name.removesuffix(".jsonl").removesuffix("_e")

    @property
    def workload(self) -> str:
        return CATEGORIES[self.dataset_name]

    @property
    def generation_length(self) -> int:
        return self.max_new_tokens or DATASETS[self.dataset_name][1]

    def rows(self) -> Iterable[Any]:
        path = Path(self.path).expanduser()
        if not path.is_file():
            raise ConfigError(f"LongBench file not found: {path}")
        return read_jsonl(path)

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        answers = row["answers"]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise ValueError("answers must be a non-empty list of strings")
        context = _middle_cut(tokenizer, require_str(row, "context"), self.context_tokens)
        prompt = DATASETS[self.dataset_name][0].format(context=context, input=str(row["input"]))
        classes = row.get("all_classes") or []
        return Sample(
            id=str(row.get("_id", index)),
            prompt=prompt,
            references=tuple(answers),
            extra={"all_classes": [str(name) for name in classes]},
        )

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        classes = sample.extra.get("all_classes", ())
        return {"score": longbench_score(self.dataset_name, prediction, sample.references, classes)}


def _middle_cut(tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return str(tokenizer.decode(ids[:half], skip_special_tokens=True)) + str(
        tokenizer.decode(ids[-half:], skip_special_tokens=True)
    )
