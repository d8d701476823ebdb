"""What a reader of the report and plots relies on: named defaults, one vocabulary, honest charts, old results."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from kvlab.bench import preset_config
from kvlab.bench.plots import curve_points, front_to_draw, is_ratio_sweep, label_offsets, method_family
from kvlab.bench.report import render_report
from kvlab.bench.results import (
    METRICS_FILE,
    PREDICTIONS_FILE,
    cell_dir,
    load_cell_metrics,
    read_predictions,
    write_json,
)
from kvlab.cli.bench import settings_summary
from tests.unit.bench.test_report import _cell


def test_settings_summary_names_the_default_preset_contexts_and_models() -> None:
    text = settings_summary(preset_config("smoke"), defaulted=True)
    assert "preset: smoke (the default: no --preset given)" in text
    assert "models: smollm2" in text and "squad (192 ctx, 8 new)" in text


def test_report_header_names_preset_models_and_each_tasks_lengths(results_folder: Path) -> None:
    config = json.loads((results_folder / "config.json").read_text())
    config.update(
        preset="smoke", models=["smollm2"], tasks=[{"name": "squad", "context_tokens": 192, "max_new_tokens": 8}]
    )
    write_json(results_folder / "config.json", config)
    report = render_report(results_folder).read_text()
    assert "- preset: smoke; models: smollm2" in report
    assert "squad (192 context tokens, 8 new tokens)" in report
    assert "KV bytes ratio" in report and "realized" not in report


def test_models_are_side_by_side_when_there_are_two(results_folder: Path) -> None:
    config = json.loads((results_folder / "config.json").read_text()) | {"models": ["smollm2", "gemma3-270m"]}
    write_json(results_folder / "config.json", config)
    cell = _cell("squad", "full", "full", 0.3, 10.0, 1.0) | {"model": "gemma3-270m"}
    write_json(cell_dir(results_folder, "gemma3-270m", "squad", "full") / METRICS_FILE, cell)
    report = render_report(results_folder).read_text()
    assert "## Models side by side" in report
    assert "| method | smollm2 quality | smollm2 fidelity | smollm2 KV bytes | gemma3-270m quality |" in report, (
        "models in the configured order"
    )
    assert (results_folder / "gemma3-270m_quality_by_task.png").is_file()


def test_models_run_one_at_a_time_into_one_folder_are_all_in_the_header_and_side_by_side(
    results_folder: Path,
) -> None:
    # `--model smollm2` then `--model gemma3-270m` into one folder: the last config names only gemma.
    config = json.loads((results_folder / "config.json").read_text()) | {"preset": "paper", "models": ["gemma3-270m"]}
    write_json(results_folder / "config.json", config)
    cell = _cell("squad", "full", "full", 0.3, 10.0, 1.0) | {"model": "gemma3-270m"}
    write_json(cell_dir(results_folder, "gemma3-270m", "squad", "full") / METRICS_FILE, cell)
    report = render_report(results_folder).read_text()
    assert "- preset: paper; models: smollm2, gemma3-270m" in report, "in the preset's order"
    assert "| method | smollm2 quality | smollm2 fidelity | smollm2 KV bytes | gemma3-270m quality |" in report


def test_labels_of_points_on_top_of_each_other_are_stacked_and_lone_points_stay_put() -> None:
    # Four rows at about the same speed and quality (the Gemma paper run's cam-50, cam-75, full, snapkv-75).
    crowd = [(9.10, 0.185), (9.12, 0.184), (9.40, 0.184), (9.45, 0.184)]
    lone = [(5.7, 0.184), (9.5, 0.10)]
    offsets = label_offsets(crowd + lone)
    heights = sorted(y / 0.185 * 300 + lift for (_, y), lift in zip(crowd, offsets[:4], strict=True))
    assert all(upper - lower >= 10.0 - 1e-9 for lower, upper in itertools.pairwise(heights)), heights
    assert offsets[4:] == [0.0, 0.0]
    assert label_offsets([]) == []


def test_a_pareto_front_needs_three_points() -> None:
    assert front_to_draw([(1.0, 2.0), (2.0, 1.0)]) == []  # two non-dominated points: no line
    assert front_to_draw([(1.0, 3.0), (2.0, 2.0), (3.0, 1.0), (0.5, 0.5)]) == [0, 1, 2]


def _swept(method: str, ratio: float, quality: float, kind: str = "lossy") -> dict[str, Any]:
    return _cell("squad", method, kind, quality, 10.0, ratio)


def test_curves_group_rows_by_method_and_order_by_kv_bytes_ratio() -> None:
    cells = [_swept("snapkv-75", 3.8, 0.2), _swept("snapkv-25", 1.3, 0.5), _swept("snapkv-50", 1.9, 0.4),
             _swept("kivi-2", 4.0, 0.3), _swept("full", 1.0, 0.5, "full")]  # fmt: skip
    assert method_family("snapkv-87.5") == "snapkv" and method_family("snapkv_agnostic-75") == "snapkv_agnostic"
    assert method_family("full") == "full"
    assert curve_points(cells, lambda c: c["primary"]) == {
        "snapkv": [(1.3, 0.5), (1.9, 0.4), (3.8, 0.2)],
        "kivi": [(4.0, 0.3)],
    }
    assert is_ratio_sweep(cells) and not is_ratio_sweep(cells[:2])


def test_results_with_old_field_names_still_load(tmp_path: Path) -> None:
    # Saved by an earlier version: a lossless row's acceptance figures were under "spec".
    old = {
        "id": "a",
        "token_ids": [1],
        "scores": {},
        "spec": {"acceptance_length": 2.5, "rounds": 3, "draft_tokens": 6},
    }
    path = tmp_path / PREDICTIONS_FILE
    path.write_text(json.dumps(old) + "\n")
    (record,) = read_predictions(path)
    assert record["lossless"] == old["spec"] and "spec" not in record
    write_json(
        cell_dir(tmp_path, "smollm2", "squad", "full") / METRICS_FILE, _cell("squad", "full", "full", 0.5, 1.0, 1.0)
    )
    assert load_cell_metrics(tmp_path)[0]["method"] == "full"


@pytest.fixture
def results_folder(tmp_path: Path) -> Path:
    from tests.unit.bench.test_report import CELLS

    write_json(tmp_path / "environment.json", {"device": "cpu", "cpu": {}, "gpu": [], "packages": {}})
    write_json(tmp_path / "config.json", {"samples": 4, "repeats": 1, "tasks": [{"name": "squad"}], "methods": []})
    for task, rows in CELLS.items():
        for method, *values in rows:
            write_json(cell_dir(tmp_path, "smollm2", task, method) / METRICS_FILE, _cell(task, method, *values))
    return tmp_path
