"""`likelihood=True` in the runner on a tiny model: every row scores the full-KV output, and the report
shows the figures beside quality and system costs, with a rate-distortion plot."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvlab.bench import BenchConfig, parse_method, run_benchmark, runner
from kvlab.bench.report import render_report
from kvlab.bench.results import PREDICTIONS_FILE, read_predictions
from kvlab.cli.bench import RUN_FIELDS, BenchCommand
from kvlab.cli.flags import given_values
from kvlab.errors import ConfigError
from kvlab.models import LoadedModel
from tests.helpers import tiny_llama

TASK = {"name": "squad", "context_tokens": 96, "max_new_tokens": 6}
METHODS = ("kivi-4", "snapkv-50", "lossless-kivi-2")


@pytest.fixture(autouse=True)
def fixed_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "code_revision", lambda: "revision-a")


@pytest.fixture(scope="module")
def tiny() -> dict[str, LoadedModel]:
    return {"tiny": tiny_llama()}


def _config(out: Path, likelihood: bool) -> BenchConfig:
    methods = tuple(parse_method(label) for label in METHODS)
    return BenchConfig(tasks=(TASK,), methods=methods, samples=2, out=str(out), models=("tiny",), likelihood=likelihood)


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory, tiny: dict[str, LoadedModel]) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("likelihood")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "code_revision", lambda: "revision-a")
        cells = run_benchmark(_config(out, likelihood=True), loaded_models=tiny)
    return out, cells


def _records(out: Path, method: str) -> list[dict[str, Any]]:
    return read_predictions(out / "tiny" / "squad" / method / PREDICTIONS_FILE)


def test_full_kv_scores_its_own_output_with_kl_zero(scored: tuple[Path, list[dict[str, Any]]]) -> None:
    _, cells = scored
    full = next(cell for cell in cells if cell["method"] == "full")["likelihood"]
    assert full["kl"] == 0.0 and full["ppl"] == full["ppl_full"] and full["num_samples"] == 2


def test_every_row_scores_the_full_kv_output_of_each_sample(scored: tuple[Path, list[dict[str, Any]]]) -> None:
    out, cells = scored
    full_by_id = {record["id"]: record for record in _records(out, "full")}
    for cell in cells:
        for record in _records(out, cell["method"]):
            figures, full = record["likelihood"], full_by_id[record["id"]]
            assert figures["num_tokens"] == len(full["token_ids"]), f"{cell['method']}/{record['id']}"
            # The same continuation through the same full cache: the same reference perplexity.
            assert figures["ppl_full"] == pytest.approx(full["likelihood"]["ppl_full"], rel=1e-6), cell["method"]
        if cell["kind"] != "full":
            assert cell["likelihood"]["kl"] > 0, f"{cell['method']}: a compressed cache changed no distribution"


def test_a_lossless_row_scores_its_drafters_cache(scored: tuple[Path, list[dict[str, Any]]]) -> None:
    _, cells = scored
    caches = {cell["method"]: cell["likelihood"]["cache"] for cell in cells}
    assert caches == {"full": "decoding", "kivi-4": "decoding", "snapkv-50": "decoding", "lossless-kivi-2": "drafter"}


def test_without_likelihood_no_teacher_pass_runs(
    tmp_path: Path, tiny: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: Any) -> None:
        raise AssertionError("teacher forcing ran with likelihood off")

    monkeypatch.setattr(runner, "measure_likelihood", refuse)
    cells = run_benchmark(_config(tmp_path, likelihood=False), loaded_models=tiny)
    assert all(cell["likelihood"] is None for cell in cells)
    assert all("likelihood" not in record for record in _records(tmp_path, "kivi-4"))


def test_a_folder_scored_without_likelihood_is_not_mixed_with_one_scored_with_it(
    scored: tuple[Path, list[dict[str, Any]]], tiny: dict[str, LoadedModel]
) -> None:
    out, _ = scored
    with pytest.raises(ConfigError, match="likelihood differ"):
        run_benchmark(_config(out, likelihood=False), loaded_models=tiny)


def test_the_report_shows_the_figures_and_the_rate_distortion_plot(scored: tuple[Path, list[dict[str, Any]]]) -> None:
    out, cells = scored
    report = render_report(out).read_text()
    kivi = next(cell for cell in cells if cell["method"] == "kivi-4")["likelihood"]
    assert "### Likelihood of the full-KV output under each method's cache" in report
    assert "| method | KL (nats/token) | PPL | PPL full | KV bytes ratio | tasks |" in report
    assert f"| kivi-4 | {kivi['kl']:.4f} | {kivi['ppl']:.3f} | {kivi['ppl_full']:.3f} |" in report
    assert "| method | quality | vs full | = full | diverges at | KL | PPL | PPL full | TTFT s |" in report
    assert "| lossless-kivi-2 †" in report, "a drafter's figures are marked"
    assert (out / "tiny_kl_vs_kv_bytes.png").stat().st_size > 0
    assert "![tiny_kl_vs_kv_bytes](tiny_kl_vs_kv_bytes.png)" in report


def test_the_bench_command_turns_likelihood_on_with_a_flag() -> None:
    parser = argparse.ArgumentParser()
    BenchCommand().add_arguments(parser)
    assert given_values(parser.parse_args(["--likelihood"]), BenchConfig, RUN_FIELDS) == {"likelihood": True}
    assert given_values(parser.parse_args([]), BenchConfig, RUN_FIELDS) == {}
