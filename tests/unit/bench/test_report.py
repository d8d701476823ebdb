"""The report renders from a results folder alone: tables per task x method and the PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvlab.bench.plots import method_points, pareto_front
from kvlab.bench.report import render_report
from kvlab.bench.results import METRICS_FILE, cell_dir, write_json
from kvlab.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# (method, kind, quality, tokens/s, realized ratio) per task; made-up but shaped like real cells.
CELLS = {
    "squad": [("full", "full", 0.50, 20.0, 1.0), ("kivi-2", "lossy", 0.40, 12.0, 4.1),
              ("snapkv-50", "lossy", 0.55, 22.0, 1.9)],
    "xsum": [("full", "full", 0.20, 21.0, 1.0), ("kivi-2", "lossy", 0.18, 11.0, 3.2),
             ("snapkv-50", "lossy", 0.12, 23.0, 1.8)],
}  # fmt: skip


def _cell(task: str, method: str, kind: str, quality: float, speed: float, ratio: float) -> dict[str, Any]:
    metric = {"squad": "f1", "xsum": "rouge_l"}[task]
    return {
        "model": "smollm2",
        "task": task,
        "workload": {"squad": "single-doc QA", "xsum": "summarization"}[task],
        "method": method,
        "kind": kind,
        "skipped_rows": 1 if task == "xsum" else 0,
        "num_samples": 4,
        "primary_metric": metric,
        "primary": quality,
        "quality": {metric: quality},
        "fidelity": {
            "output_exact_match": 1.0 if kind == "full" else 0.25,
            "matched_prefix": 1.0 if kind == "full" else 0.4,
            "first_divergence_median": None if kind == "full" else 3,
            "num_compared": 4,
        },
        "system": {"ttft_s": 0.5, "decode_tokens_per_s": speed, "kv_bytes_ratio": ratio,
                   "peak_kv_resident_bytes": 3 * 2**20, "acceptance_length": None},
    }  # fmt: skip


@pytest.fixture
def results_folder(tmp_path: Path) -> Path:
    environment = {"git_revision": {"commit": "abc123", "dirty": False}, "device": "cpu",
                   "cpu": {"processor": "x86_64"}, "gpu": [], "packages": {"torch": "2"}}  # fmt: skip
    write_json(tmp_path / "environment.json", environment)
    methods = [{"label": label} for label in ("snapkv-50", "kivi-2")]
    write_json(tmp_path / "config.json", {"samples": 4, "repeats": 1, "tasks": [{"name": "xsum"}, {"name": "squad"}],
                                          "methods": methods})  # fmt: skip
    for task, rows in CELLS.items():
        for method, *values in rows:
            write_json(cell_dir(tmp_path, "smollm2", task, method) / METRICS_FILE, _cell(task, method, *values))
    return tmp_path


def test_report_has_a_summary_matrix_and_a_table_per_task(results_folder: Path) -> None:
    report = render_report(results_folder).read_text()
    assert "| method | xsum (rouge_l) | squad (f1) | mean |" in report
    assert "| kivi-2 | 0.180 | 0.400 | 0.290 |" in report
    assert "### squad — single-doc QA (f1, 4 samples)" in report
    assert "| snapkv-50 | 0.550 | +10% | 0.250 | 3 | 0.50 | 22.0 | 1.90x | 3.0 |  |" in report
    assert "1 malformed data row(s) were skipped." in report
    assert "abc123" in report


def test_report_lists_tasks_and_methods_in_run_order_with_full_kv_first(results_folder: Path) -> None:
    report = render_report(results_folder).read_text()
    assert report.index("### xsum") < report.index("### squad")
    squad = report[report.index("### squad") :]
    assert squad.index("| full |") < squad.index("| snapkv-50 |") < squad.index("| kivi-2 |")


def test_report_writes_the_plots_it_links(results_folder: Path) -> None:
    report = render_report(results_folder).read_text()
    for name in ("quality_vs_throughput", "quality_by_task", "kv_bytes_ratio"):
        path = results_folder / f"smollm2_{name}.png"
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000, name
        assert f"]({path.name})" in report


def test_report_of_an_empty_or_missing_folder_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no finished benchmark cells"):
        render_report(tmp_path)
    with pytest.raises(ConfigError, match="results folder not found"):
        render_report(tmp_path / "missing")


def test_pareto_front_keeps_only_undominated_points() -> None:
    points = [(20.0, 0.35), (11.5, 0.29), (22.5, 0.335), (10.0, 0.5), (22.5, 0.2)]
    assert pareto_front(points) == [3, 0, 2]


def test_method_points_average_quality_and_take_median_speed() -> None:
    cells = [_cell(task, method, *values) for task, rows in CELLS.items() for method, *values in rows]
    points = method_points(cells)
    assert points["kivi-2"] == pytest.approx((11.5, 0.29))


def test_task_table_shows_secondary_scores_and_acceptance_length(tmp_path: Path) -> None:
    cell = _cell("squad", "lossless-kivi-2", "lossless", 0.5, 8.0, 4.0)
    cell["quality"]["exact_match"] = 0.25
    cell["system"]["acceptance_length"] = 3.46
    write_json(cell_dir(tmp_path, "smollm2", "squad", "lossless-kivi-2") / METRICS_FILE, cell)
    assert "| exact_match 0.250, acceptance length 3.5 |" in render_report(tmp_path).read_text()
