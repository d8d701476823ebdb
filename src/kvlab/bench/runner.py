"""Run a benchmark matrix: every model x task x method cell, resumable, one sample at a time.

Each finished sample is appended to the cell's predictions file at once, so an interrupted run loses
at most the sample in flight; a cell whose `metrics.json` exists is skipped. Full KV runs first in
every task, so fidelity can compare each method's outputs with the full-KV outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from kvlab.bench import results
from kvlab.bench.config import BenchConfig
from kvlab.bench.methods import FULL_LABEL, BenchMethod, run_method
from kvlab.bench.multiturn import compressor_for_turn
from kvlab.bench.summary import median_stats, summarize_cell
from kvlab.bench.system import RunRevision, code_revision, environment_record, git_revision, track_peak_memory
from kvlab.bench.tasks import Sample, Task, TaskData, tasks
from kvlab.bench.teacher import TeacherForcing, measure_likelihood
from kvlab.compress import Compressor
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessOutput
from kvlab.models import LoadedModel, load_model
from kvlab.store.prefix import PrefixCache, PrefixConfig, PrefixSource

logger = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 64
WARMUP_NEW_TOKENS = 2
# Chunk size of a shared-context cell's prefix store: a turn reuses the earlier turns' tokens in whole
# chunks, and prefill runs in forwards cut at chunk boundaries.
SHARED_CONTEXT_CHUNK_TOKENS = 128


class BenchCallbacks:
    """Hooks the CLI uses for its progress bar; the defaults do nothing."""

    def on_begin(self, config: BenchConfig) -> None:
        """The matrix is valid, its data and output folder are usable, and models are about to load."""

    def on_start(self, model: str, total_samples: int) -> None:
        """Before a model's cells: how many samples remain to be generated for it."""

    def on_cell(self, model: str, task: str, method: str) -> None:
        """A cell starts (or resumes)."""

    def on_sample(self) -> None:
        """One sample finished."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRun:
    """What every cell of one model's run shares: the output folder, the model, the matrix and its hooks.

    `revision` is the code the run started with (each cell's fingerprint and metrics record it);
    `warmed` holds the labels of methods already warmed up in this process (the cells add to it).
    """

    out: Path
    model: str
    loaded: LoadedModel
    config: BenchConfig
    callbacks: BenchCallbacks
    revision: RunRevision
    warmed: set[str]


@dataclasses.dataclass(slots=True)
class PreparedTask:
    """A task with its samples and their prompt token ids for one model."""

    task: Task
    data: TaskData
    prompts: list[list[int]]

    @property
    def name(self) -> str:
        return self.task.registry_name


def run_benchmark(
    config: BenchConfig,
    callbacks: BenchCallbacks | None = None,
    loaded_models: Mapping[str, LoadedModel] | None = None,
) -> list[dict[str, Any]]:
    """Run (or resume) the matrix and return every cell's metrics.

    Args:
        config: The matrix and how to run it.
        callbacks: Progress hooks.
        loaded_models: Models already in memory, by the name used in `config.models` (tests pass
            tiny models here); others are loaded with `load_model`.

    Raises:
        ConfigError: Unwritable output folder, missing data package, prompts too long for the model,
            or a folder holding results of other settings.
    """
    out = results.prepare_output_dir(config.out)
    with torch_threads(config.threads):
        return _run_models(config, out, callbacks or BenchCallbacks(), loaded_models or {})


def _run_models(
    config: BenchConfig, out: Path, callbacks: BenchCallbacks, loaded_models: Mapping[str, LoadedModel]
) -> list[dict[str, Any]]:
    task_objects = [tasks.from_dict(spec) for spec in config.tasks]
    for task in task_objects:
        task.check_data()
    callbacks.on_begin(config)
    results.write_json(out / "config.json", config.to_dict())
    results.write_json(out / "environment.json", environment_record(config.device))
    # Once per run: the code in memory is the code at start, whatever is committed meanwhile.
    revision = RunRevision(code_revision(), git_revision())
    cells: list[dict[str, Any]] = []
    for model in config.models:
        loaded = loaded_models.get(model) or load_model(model, dtype=config.dtype, device=config.device)
        prepared = [prepare_task(loaded, task, config.samples) for task in task_objects]
        callbacks.on_start(model, _remaining_samples(out, model, prepared, config.methods))
        warmed: set[str] = set() if config.warmup else {method.label for method in config.methods}
        model_run = ModelRun(out, model, loaded, config, callbacks, revision, warmed)
        for item in prepared:
            for method in config.methods:
                callbacks.on_cell(model, item.name, method.label)
                cells.append(run_cell(model_run, item, method))
    return cells


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` torch CPU threads (unchanged when None), restoring the setting after."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def prepare_task(loaded: LoadedModel, task: Task, num_samples: int) -> PreparedTask:
    """Load a task's samples and encode them, checking that each fits in the model's context."""
    data = task.load(loaded.tokenizer, num_samples)
    if not data.samples:
        raise ConfigError(f"task {task.registry_name!r} produced no samples ({data.skipped_rows} malformed rows)")
    prompts = [encode_sample(loaded, sample) for sample in data.samples]
    limit = loaded.architecture.max_context
    longest = max(len(prompt) for prompt in prompts)
    if longest + task.generation_length > limit:
        raise ConfigError(
            f"task {task.registry_name!r}: a prompt has {longest} tokens, which with {task.generation_length} new "
            f"tokens exceeds the model's context of {limit}; lower the task's context_tokens"
        )
    return PreparedTask(task, data, prompts)


def encode_sample(loaded: LoadedModel, sample: Sample) -> list[int]:
    """Prompt ids: the chat-templated prompt, then the answer prefix as the start of the answer."""
    ids = loaded.encode_prompt(sample.prompt)
    if sample.answer_prefix:
        # After a chat template the prefix opens the assistant turn; in plain text it needs a space.
        separator = "" if loaded.has_chat_template else " "
        ids += loaded.tokenizer(separator + sample.answer_prefix, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]


def warm_up(loaded: LoadedModel, method: BenchMethod, prompt: list[int]) -> None:
    """One short generation so first-call costs (allocation, lazy initialisation) are not measured."""
    config = GenerationConfig(max_new_tokens=WARMUP_NEW_TOKENS, ignore_eos=True)
    run_method(loaded, method, [prompt[:WARMUP_PROMPT_TOKENS]], config)


def run_cell(model_run: ModelRun, item: PreparedTask, method: BenchMethod) -> dict[str, Any]:
    """Generate and score the cell's missing samples, then write and return its metrics."""
    directory = results.cell_dir(model_run.out, model_run.model, item.name, method.label)
    fingerprint = cell_fingerprint(model_run.model, item.task, method, model_run.config, model_run.revision.source)
    finished = _finished_metrics(directory, fingerprint, len(item.data.samples))
    if finished is not None:
        return finished
    results.claim_cell(directory, fingerprint)
    predictions = directory / results.PREDICTIONS_FILE
    wanted = {sample.id for sample in item.data.samples}
    stored = results.read_predictions(predictions)
    results.rewrite_predictions(predictions, stored)  # drops a torn line before appending
    records = [record for record in stored if record["id"] in wanted]
    done = {record["id"] for record in records}
    generation = GenerationConfig(max_new_tokens=item.task.generation_length, stop_strings=item.task.stop_strings)
    selections: dict[str, dict[int, torch.Tensor]] = {}  # per document: the kept positions per layer at turn 1
    # What likelihood scores: full KV's output of each sample (full KV runs first; its own cell scores its own).
    full_records = [] if method.label == FULL_LABEL else _full_records(model_run.out, model_run.model, item.name)
    full_outputs = {record["id"]: record["token_ids"] for record in full_records}
    with _shared_context_store(model_run.loaded, item.task) as prefix:
        for sample, prompt in zip(item.data.samples, item.prompts, strict=True):
            if sample.id in done:
                continue
            if method.label not in model_run.warmed:
                warm_up(model_run.loaded, method, prompt)
                model_run.warmed.add(method.label)
            run = _sample_run(item, method, sample, prompt, prefix, selections)
            repeats = model_run.config.repeats
            record = measure_sample(model_run.loaded, run, item.task, sample, prompt, generation, repeats)
            if model_run.config.likelihood:
                continuation = record["token_ids"] if method.label == FULL_LABEL else full_outputs.get(sample.id)
                record["likelihood"] = sample_likelihood(model_run.loaded, run, prompt, continuation)
            if prefix is not None:
                prefix.flush()  # the next turn reuses what this one saved
            results.append_prediction(predictions, record)
            records.append(record)
            model_run.callbacks.on_sample()
    if method.label == FULL_LABEL:
        full_records = records
    header = {
        "model": model_run.model,
        "task": item.name,
        "workload": item.task.workload,
        "method": method.label,
        "kind": method.kind,
        "scorer": item.task.scorer,
        "skipped_rows": item.data.skipped_rows,
        "fingerprint": fingerprint,
        "git_revision": model_run.revision.commit,
    }
    metrics = summarize_cell(records, full_records, item.task.primary_metric, header)
    results.write_json(directory / results.METRICS_FILE, metrics)
    return metrics


@dataclasses.dataclass(frozen=True, slots=True)
class SampleRun:
    """How one sample is generated: its row, the compressor it runs with, the prefix store it reuses."""

    method: BenchMethod
    compressor: Compressor | None = None
    prefix: PrefixSource | None = None


@contextlib.contextmanager
def _shared_context_store(loaded: LoadedModel, task: Task) -> Iterator[PrefixCache | None]:
    """An in-memory prefix store for a shared-context task's cell (None for other tasks), closed after."""
    if not task.shared_context:
        yield None
        return
    prefix = PrefixCache.for_model(loaded, "memory://", PrefixConfig(chunk_tokens=SHARED_CONTEXT_CHUNK_TOKENS))
    try:
        yield prefix
    finally:
        prefix.close()


def _sample_run(
    item: PreparedTask,
    method: BenchMethod,
    sample: Sample,
    prompt: list[int],
    prefix: PrefixCache | None,
    selections: dict[str, dict[int, torch.Tensor]],
) -> SampleRun:
    """How a sample runs; a later turn of a conversation keeps turn 1's compression and reuses the store."""
    compressor = method.build_compressor()
    if not item.task.shared_context:
        return SampleRun(method, compressor)
    document, turn = sample.extra["document"], sample.extra["turn"]
    if turn == 1:
        selections[document] = {}
    first = next(
        p
        for s, p in zip(item.data.samples, item.prompts, strict=True)
        if s.extra["document"] == document and s.extra["turn"] == 1
    )
    # A resumed conversation whose turn 1 ran in an earlier process has no record: it compresses anew.
    recorded = selections.setdefault(document, {})
    return SampleRun(method, compressor_for_turn(compressor, recorded, first, prompt), prefix if turn > 1 else None)


def measure_sample(
    loaded: LoadedModel,
    run: SampleRun,
    task: Task,
    sample: Sample,
    prompt: list[int],
    generation: GenerationConfig,
    repeats: int,
) -> dict[str, Any]:
    """Generate `repeats` times (median timings), score the output, and return the sample's record.

    Raises:
        Exception: What failed a generation (`generate` raises it rather than return a failed request
            as an answer): no record is made, so the cell stays unfinished and a resumed run retries it.
    """
    method = run.method
    runs, outputs, lossless_stats = [], [], []
    with track_peak_memory(loaded.device) as peak:
        for _ in range(repeats):
            output = run_method(loaded, method, [prompt], generation, compressor=run.compressor, prefix=run.prefix)
            outputs.append(output.requests[0])
            runs.append(dataclasses.asdict(output.stats))
            lossless_stats.append(output.lossless if isinstance(output, LosslessOutput) else None)
    request = outputs[0]
    if any(other.token_ids != request.token_ids for other in outputs[1:]):
        logger.warning("%s/%s: repeated greedy runs gave different outputs", method.label, sample.id)
    return {
        "id": sample.id,
        "turn": sample.extra.get("turn"),
        "prediction": request.text,
        "token_ids": request.token_ids,
        "stop_reason": request.stop_reason,
        "references": list(sample.references),
        "scores": task.score(request.text, sample),
        "stats": median_stats(runs),
        "memory": dataclasses.asdict(peak),
        "lossless": _lossless_summary(lossless_stats),
    }


def sample_likelihood(
    loaded: LoadedModel, run: SampleRun, prompt: list[int], continuation: list[int] | None
) -> dict[str, Any] | None:
    """KL and perplexities of the full-KV `continuation` under the cache the sample's method compresses.

    Lossy rows score the cache they decode from, lossless rows their drafter's (their output is full
    KV's); full KV scores itself (KL 0). None without a continuation to score.
    """
    if not continuation:
        return None
    # A turn that reuses a prefix store prefills in the store's chunks: teacher forcing cuts the same.
    chunk_tokens = SHARED_CONTEXT_CHUNK_TOKENS if run.prefix is not None else None
    compressor = None if run.method.kind == "full" else run.compressor
    figures = measure_likelihood(loaded, TeacherForcing(prompt, continuation, compressor, chunk_tokens))
    return {**figures.to_dict(), "cache": "drafter" if run.method.kind == "lossless" else "decoding"}


def _lossless_summary(lossless_stats: list[Any]) -> dict[str, Any] | None:
    """Acceptance of a lossless method's drafts (first run), or None for other methods."""
    first = lossless_stats[0]
    if first is None:
        return None
    return {
        "acceptance_length": first.acceptance_length,
        "rounds": first.rounds,
        "draft_tokens": first.num_draft_tokens,
    }


def cell_fingerprint(model: str, task: Task, method: BenchMethod, config: BenchConfig, revision: str) -> dict[str, Any]:
    """What a cell's results depend on, code revision included; a folder made with another is never mixed in."""
    return {
        "code_revision": revision,
        "model": model,
        "dtype": config.dtype,
        "device": config.device,
        "task": task.to_dict(),
        "method": method.to_dict(),
        "repeats": config.repeats,
        "likelihood": config.likelihood,
    }


def _finished_metrics(directory: Path, fingerprint: dict[str, Any], num_samples: int) -> dict[str, Any] | None:
    metrics = results.read_json(directory / results.METRICS_FILE)
    if (
        isinstance(metrics, dict)
        and metrics.get("fingerprint") == fingerprint
        and metrics.get("num_samples") == num_samples
    ):
        return metrics
    return None


def _full_records(out: Path, model: str, task: str) -> list[dict[str, Any]]:
    return results.read_predictions(results.cell_dir(out, model, task, FULL_LABEL) / results.PREDICTIONS_FILE)


def _remaining_samples(out: Path, model: str, prepared: list[PreparedTask], methods: tuple[BenchMethod, ...]) -> int:
    remaining = 0
    for item in prepared:
        wanted = {sample.id for sample in item.data.samples}
        for method in methods:
            predictions = results.cell_dir(out, model, item.name, method.label) / results.PREDICTIONS_FILE
            remaining += len(wanted - {record["id"] for record in results.read_predictions(predictions)})
    return remaining
