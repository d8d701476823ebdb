"""The runner on a tiny model: files written, resume after interruption, no mixing of settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvlab.bench import BenchConfig, parse_method, run_benchmark, runner
from kvlab.bench.results import METRICS_FILE, PREDICTIONS_FILE, read_predictions
from kvlab.errors import ConfigError
from kvlab.models import LoadedModel
from tests.helpers import tiny_llama

TASKS = (
    {"name": "squad", "context_tokens": 96, "max_new_tokens": 4},
    {"name": "xsum", "context_tokens": 64, "max_new_tokens": 4},
)


@pytest.fixture(autouse=True)
def fixed_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    # The working tree may change while a test runs (the digest of uncommitted changes with it).
    monkeypatch.setattr(runner, "code_revision", lambda: "revision-a")


@pytest.fixture(scope="module")
def tiny() -> dict[str, LoadedModel]:
    return {"tiny": tiny_llama()}


def _config(out: Path, samples: int = 2, **overrides: Any) -> BenchConfig:
    fields: dict[str, Any] = {
        "tasks": TASKS,
        "methods": (parse_method("kivi-4"), parse_method("snapkv-50")),
        "samples": samples,
        "out": str(out),
        "models": ("tiny",),
        **overrides,
    }
    return BenchConfig(**fields)


class CountingRunMethod:
    """Wraps `run_method` to count generations (warm-ups included)."""

    def __init__(self) -> None:
        self.calls = 0
        self.wrapped = runner.run_method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.wrapped(*args, **kwargs)


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> CountingRunMethod:
    counting = CountingRunMethod()
    monkeypatch.setattr(runner, "run_method", counting)
    return counting


def test_full_kv_is_always_the_first_row() -> None:
    config = _config(Path("unused"))
    assert [method.label for method in config.methods] == ["full", "kivi-4", "snapkv-50"]


def test_a_run_writes_predictions_metrics_and_the_environment(tmp_path: Path, tiny: dict[str, LoadedModel]) -> None:
    cells = run_benchmark(_config(tmp_path), loaded_models=tiny)
    assert len(cells) == 6
    environment = json.loads((tmp_path / "environment.json").read_text())
    assert {"git_revision", "packages", "cpu", "gpu", "python"} <= set(environment)
    assert environment["packages"]["torch"]
    for cell in cells:
        directory = tmp_path / "tiny" / cell["task"] / cell["method"]
        assert len(read_predictions(directory / PREDICTIONS_FILE)) == 2
        assert json.loads((directory / METRICS_FILE).read_text()) == json.loads(json.dumps(cell))
        assert cell["num_samples"] == 2 and cell["primary"] is not None
        assert cell["system"]["ttft_s"] > 0 and cell["system"]["kv_bytes_ratio"] >= 1.0
    full = [cell for cell in cells if cell["method"] == "full"]
    assert all(cell["fidelity"]["output_exact_match"] == 1.0 for cell in full)
    snapkv = next(cell for cell in cells if cell["method"] == "snapkv-50" and cell["task"] == "squad")
    assert snapkv["system"]["kv_bytes_ratio"] > 1.5, "half the prompt evicted must show in the realized ratio"


def test_a_finished_run_is_skipped_entirely(
    tmp_path: Path, tiny: dict[str, LoadedModel], counter: CountingRunMethod
) -> None:
    first = run_benchmark(_config(tmp_path), loaded_models=tiny)
    calls = counter.calls
    assert calls == 6 * 2 + 3, "every sample once, plus one warm-up per method"
    second = run_benchmark(_config(tmp_path), loaded_models=tiny)
    assert counter.calls == calls, "finished cells must not generate again"
    assert second == first


def test_an_interrupted_cell_resumes_without_redoing_finished_samples(
    tmp_path: Path, tiny: dict[str, LoadedModel], counter: CountingRunMethod
) -> None:
    run_benchmark(_config(tmp_path), loaded_models=tiny)
    cell = tmp_path / "tiny" / "squad" / "kivi-4"
    predictions = cell / PREDICTIONS_FILE
    kept = predictions.read_text().splitlines()[0]
    predictions.write_text(kept + "\n" + '{"id": "torn-by-a-kill', encoding="utf-8")
    (cell / METRICS_FILE).unlink()
    before = counter.calls
    cells = run_benchmark(_config(tmp_path), loaded_models=tiny)
    assert counter.calls - before == 2, "one missing sample plus the method's warm-up"
    records = read_predictions(predictions)
    assert len(records) == 2 and records[0] == json.loads(kept)
    assert next(c for c in cells if c["task"] == "squad" and c["method"] == "kivi-4")["num_samples"] == 2


def test_more_samples_extend_finished_cells(
    tmp_path: Path, tiny: dict[str, LoadedModel], counter: CountingRunMethod
) -> None:
    run_benchmark(_config(tmp_path, samples=1), loaded_models=tiny)
    before = counter.calls
    cells = run_benchmark(_config(tmp_path, samples=2), loaded_models=tiny)
    assert counter.calls - before == 6 + 3, "one new sample per cell, plus warm-ups"
    assert all(cell["num_samples"] == 2 for cell in cells)


def test_results_of_other_settings_are_never_mixed(tmp_path: Path, tiny: dict[str, LoadedModel]) -> None:
    run_benchmark(_config(tmp_path, samples=1), loaded_models=tiny)
    changed = ({**TASKS[0], "max_new_tokens": 6}, TASKS[1])
    with pytest.raises(ConfigError, match="holds results made with other settings"):
        run_benchmark(_config(tmp_path, samples=1, tasks=changed), loaded_models=tiny)


def test_an_unwritable_output_folder_is_a_config_error(tmp_path: Path, tiny: dict[str, LoadedModel]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot write results to"):
        run_benchmark(_config(blocker / "results"), loaded_models=tiny)


def test_prompts_longer_than_the_model_context_are_refused_before_running(
    tmp_path: Path, tiny: dict[str, LoadedModel]
) -> None:
    too_long = ({"name": "squad", "context_tokens": 1024},)
    with pytest.raises(ConfigError, match="exceeds the model's context of 512"):
        run_benchmark(_config(tmp_path, tasks=too_long), loaded_models=tiny)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"samples": 0}, "samples must be at least 1"),
        ({"tasks": ()}, "no tasks given; choose from: bfcl"),
        ({"tasks": ({"name": "nope"},)}, "unknown task 'nope'; choose one of"),
        ({"tasks": (TASKS[0], TASKS[0])}, "each task may appear once"),
        ({"threads": 0}, "threads must be at least 1"),
    ],
)
def test_bad_configs_are_config_errors(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(Path("unused"), **overrides)


def test_every_cell_records_the_commit_the_run_started_with(
    tmp_path: Path, tiny: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A commit made while a long run goes on must not be credited with the cells finished after it.
    commits = iter([{"commit": f"commit-{index}", "dirty": False} for index in range(100)])
    monkeypatch.setattr(runner, "git_revision", lambda: next(commits))
    cells = run_benchmark(_config(tmp_path, samples=1, warmup=False), loaded_models=tiny)
    assert len(cells) == 6
    assert {cell["git_revision"]["commit"] for cell in cells} == {"commit-0"}


def test_cells_of_other_code_are_never_reused(
    tmp_path: Path, tiny: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, samples=1, tasks=TASKS[:1], warmup=False)
    run_benchmark(config, loaded_models=tiny)
    monkeypatch.setattr(runner, "code_revision", lambda: "revision-b")
    with pytest.raises(ConfigError, match="code_revision differ: the code changed since"):
        run_benchmark(config, loaded_models=tiny)
