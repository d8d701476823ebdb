"""`kvlab bench --preset smoke` end to end on the embedded model: every shipped task, report and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.bench.presets import SMOKE
from kvlab.bench.results import PREDICTIONS_FILE, read_predictions
from kvlab.cli import main

pytestmark = pytest.mark.integration

# KIVI keeps its residual window (128) plus a partial group (up to 31) in full precision.
KIVI_FULL_PRECISION_TOKENS = 160


def test_smoke_preset_runs_every_task_and_renders_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "smoke"
    assert main(["bench", "--preset", "smoke", "--out", str(out), "--threads", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cells = result["cells"]
    assert len(cells) == len(SMOKE.tasks) * len(SMOKE.methods)
    assert {cell["task"] for cell in cells} == {spec["name"] for spec in SMOKE.tasks}
    for cell in cells:
        assert cell["num_samples"] == SMOKE.samples and cell["skipped_rows"] == 0
        assert 0.0 <= cell["primary"] <= 1.0
        predictions = read_predictions(out / "smollm2" / cell["task"] / cell["method"] / PREDICTIONS_FILE)
        assert all(record["token_ids"] for record in predictions), f"{cell['task']}/{cell['method']} generated nothing"
        if cell["kind"] == "full":
            assert cell["fidelity"]["output_exact_match"] == 1.0
        elif cell["system"]["prompt_tokens"] > KIVI_FULL_PRECISION_TOKENS:
            assert cell["system"]["kv_bytes_ratio"] > 1.0, f"{cell['task']}: KIVI-2 stored as much as full KV"
    report = Path(result["report"]).read_text()
    assert "### niah — retrieval" in report and "| kivi-2 |" in report
    assert "- preset: smoke; models: smollm2" in report and "squad (192 context tokens, 8 new tokens)" in report
    assert "Scorer: RULER string_match_all." in report
    assert (out / "smollm2_quality_vs_throughput.png").stat().st_size > 0

    # Finished cells are skipped: a second run changes no prediction file.
    before = {path: path.read_bytes() for path in out.glob(f"*/*/*/{PREDICTIONS_FILE}")}
    assert main(["bench", "--preset", "smoke", "--out", str(out), "--json"]) == 0
    assert {path: path.read_bytes() for path in out.glob(f"*/*/*/{PREDICTIONS_FILE}")} == before
