"""`kvlab bench --preset smoke` end to end on the embedded model: every shipped task, report and plots;
and the likelihood figures of one task against transformers' own forward."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvlab.bench import parse_method, preset_config, run_benchmark, tasks
from kvlab.bench.likelihood import perplexity
from kvlab.bench.presets import SMOKE
from kvlab.bench.report import render_report
from kvlab.bench.results import PREDICTIONS_FILE, read_predictions
from kvlab.bench.runner import prepare_task
from kvlab.cli import main
from kvlab.models import LoadedModel
from tests.helpers import plain_attention

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


def test_likelihood_of_the_full_kv_output_matches_transformers_on_the_embedded_model(
    tmp_path: Path, embedded_model: LoadedModel
) -> None:
    squad = next(spec for spec in SMOKE.tasks if spec["name"] == "squad")
    methods = (parse_method("kivi-2"), parse_method("streamingllm-75"))
    config = preset_config("smoke", methods=methods, tasks=(squad,), out=str(tmp_path), threads=1, likelihood=True)
    cells = {cell["method"]: cell for cell in run_benchmark(config, loaded_models={"smollm2": embedded_model})}
    assert cells["full"]["likelihood"]["kl"] == 0.0
    for method in ("kivi-2", "streamingllm-75"):
        assert 0.0 < cells[method]["likelihood"]["kl"] < math.inf, f"{method}: {cells[method]['likelihood']}"
    # The independent reference: transformers' own attention over prompt + full-KV output; fp32 both, so
    # only the order of the sums differs (measured: 4e-7 relative on this prompt).
    prompt = prepare_task(embedded_model, tasks.from_dict(squad), 1).prompts[0]
    output = read_predictions(tmp_path / "smollm2" / "squad" / "full" / PREDICTIONS_FILE)[0]["token_ids"]
    with plain_attention(embedded_model), torch.inference_mode():
        logits = embedded_model.model(input_ids=torch.tensor([prompt + output]), use_cache=False).logits[0]
    expected = perplexity(logits[len(prompt) - 1 : -1], output)
    assert cells["full"]["likelihood"]["ppl_full"] == pytest.approx(expected, rel=1e-5)
    assert cells["kivi-2"]["likelihood"]["ppl_full"] == pytest.approx(expected, rel=1e-5)
    render_report(tmp_path)
    assert (tmp_path / "smollm2_kl_vs_kv_bytes.png").stat().st_size > 0
