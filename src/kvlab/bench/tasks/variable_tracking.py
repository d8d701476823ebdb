"""Variable tracking: follow a chain of assignments hidden in filler text (RULER's vt task)."""

from __future__ import annotations

import dataclasses
import itertools
import string
from collections.abc import Iterable
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.metrics import string_match_all
from kvlab.bench.tasks.base import Sample, count_tokens, tasks
from kvlab.bench.tasks.ruler import RulerTask, ruler_template
from kvlab.errors import ConfigError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@tasks.register("variable_tracking")
@dataclasses.dataclass
class VariableTrackingTask(RulerTask):
    """RULER variable tracking: name every variable of a hidden assignment chain; string match.

    `num_hops` chained assignments `VAR B = VAR A` are hidden among repeated filler sentences; the
    answer must list every variable that holds the first value (RULER's string match over all of them).

    Generated (no data file); the template comes from the package. Deviation: no in-context example
    is prepended (RULER adds one; it costs context the small default model needs for the task).
    """

    category: ClassVar[str] = "retrieval"
    primary_metric: ClassVar[str] = "string_match"
    scorer: ClassVar[str] = "RULER string_match_all"
    default_max_new_tokens: ClassVar[int] = 30

    num_hops: int = dataclasses.field(default=4, metadata={"help": "assignments after the first"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_hops < 1:
            raise ConfigError(f"num_hops must be at least 1, got {self.num_hops}")

    def rows(self) -> Iterable[Any]:
        ruler_template("variable_tracking")  # fails early, naming the package, when it is missing
        return itertools.count()

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        rng = self.rng(index)
        names: list[str] = []
        while len(names) < self.num_hops + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names:
                names.append(name)
        value = str(rng.randint(10000, 99999))
        chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(self.num_hops)]
        template = ruler_template("variable_tracking")
        overhead = count_tokens(tokenizer, template["template"] + " ".join(chain))
        num_noises = max((self.context_tokens - overhead) // max(count_tokens(tokenizer, NOISE + "\n"), 1), len(chain))
        sentences = [NOISE] * num_noises
        positions = sorted(rng.sample(range(num_noises), len(chain)))
        for shift, (position, assignment) in enumerate(zip(positions, chain, strict=True)):
            sentences.insert(position + shift, assignment)
        context = "\n".join(sentences)
        prompt = template["template"].format(context=context, query=value)
        prefix = template["answer_prefix"].format(num_v=len(names), query=value).strip()
        return Sample(id=f"vt-{index}", prompt=prompt, references=tuple(names), answer_prefix=prefix)

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {"string_match": string_match_all(prediction, sample.references)}
