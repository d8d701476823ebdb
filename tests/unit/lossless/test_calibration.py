"""The cost model's calibration: its forwards stay in the fit however many rounds of one shape follow, and a
later run on the same machine starts from the kept calibration without running it again."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from kvlab.attention_kernels import newest_kernel_queries
from kvlab.compress import create_compressor
from kvlab.engine import Engine, Request
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessConfig, calibration
from kvlab.lossless import calibration as calibration_module
from kvlab.lossless.calibration import CALIBRATION_DIR_ENV, CalibrationStore, source_digest
from kvlab.lossless.cost_model import ForwardCostModel, LinearFit, SegmentShape, features
from kvlab.models import forward_kind
from tests.helpers import tiny_llama
from tests.unit.lossless.test_lossless import DRAFTERS, _prompts

TRUTH = torch.tensor([0.020, 0.0005, 0.002, 0.006, 0.002, 0.003, 0.001], dtype=torch.float64)


def _seconds(segments: list[SegmentShape]) -> float:
    return float(torch.dot(TRUTH, torch.tensor(features(segments), dtype=torch.float64)))


def _worst_extrapolation(anchored: bool, seed: int) -> float:
    """The worst relative error, at 0, 2, 4 and 32 drafts, of a fit that saw a calibration (anchored or not)
    and then 200 verifies of 8 to 10 drafts with 5% noise, as a run that keeps choosing about one length."""
    generator = torch.Generator().manual_seed(seed)
    fit = LinearFit()
    for shape in ([SegmentShape(tokens, 8000)] for tokens in (1, 1, 9, 17)):
        fit.observe(features(shape), _seconds(shape), anchored=anchored)
    for index in range(200):
        shape = [SegmentShape(int(torch.randint(9, 12, (1,), generator=generator)), 8000 + index)]
        if index % 10 == 0:
            shape = [SegmentShape(1, 8000 + index)]
        noise = 1 + 0.05 * float(torch.randn(1, generator=generator))
        fit.observe(features(shape), _seconds(shape) * noise)
    shapes = [[SegmentShape(length + 1, 8200)] for length in (0, 2, 4, 32)]
    return max(abs(fit.predict(features(shape)) - _seconds(shape)) / _seconds(shape) for shape in shapes)


def test_calibration_forwards_keep_other_lengths_priced_after_rounds_of_about_one_length() -> None:
    anchored = [_worst_extrapolation(True, seed) for seed in range(5)]
    forgotten = [_worst_extrapolation(False, seed) for seed in range(5)]
    assert sum(anchored) < 0.7 * sum(forgotten), (anchored, forgotten)


def _lossless_run(loaded: object) -> list[int]:
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    lossless = LosslessConfig(create_compressor("snapkv", **DRAFTERS["snapkv"]), "auto",  # type: ignore[arg-type]
                              draft_weights="bf16")
    engine = Engine(loaded)  # type: ignore[arg-type]
    request_id = engine.add_request(Request(_prompts(60)[0], config, lossless=lossless))
    while engine.has_work():
        engine.step()
    return engine.output(request_id).token_ids


def test_a_later_run_starts_from_the_kept_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CALIBRATION_DIR_ENV, str(tmp_path))
    timed: list[int] = []
    original = calibration_module._timed_packed
    monkeypatch.setattr(calibration_module, "_timed_packed",
                        lambda *args, **kwargs: timed.append(1) or original(*args, **kwargs))
    loaded = tiny_llama(num_kv_heads=2)
    first = _lossless_run(loaded)
    kept = list(tmp_path.glob("*.json"))
    assert len(kept) == 1 and timed
    rows = json.loads(kept[0].read_text())["rows"]
    assert set(rows) == {"same", "bf16"} and all(len(row) == 8 for weight_rows in rows.values() for row in weight_rows)
    # Where the C++ kernel runs, one calibration verify is short enough for it: its extra pairs are priced.
    kernel_queries = newest_kernel_queries(loaded.architecture.num_kv_groups, loaded.device, loaded.dtype)
    assert any(row[4] > 0 for row in rows["same"]) == (kernel_queries > 1)
    timed.clear()
    assert _lossless_run(loaded) == first
    assert not timed  # fitted from the file: no calibration forward ran
    costs = ForwardCostModel()
    CalibrationStore.for_model(loaded.source, loaded.dtype, loaded.device, forward_kind(loaded.model)).restore(costs)
    assert costs.ready("same") and costs.ready("bf16")
    assert costs.calibration == rows


def test_an_unreadable_kept_calibration_is_a_run_that_calibrates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(CALIBRATION_DIR_ENV, str(tmp_path))
    loaded = tiny_llama(num_kv_heads=2)
    store = CalibrationStore.for_model(loaded.source, loaded.dtype, loaded.device, forward_kind(loaded.model))
    assert store.path is not None
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_text("{not json")
    _lossless_run(loaded)
    assert "ignoring the kept calibration" in caplog.text
    assert json.loads(store.path.read_text())["rows"]  # replaced by this run's


def test_the_kept_calibration_is_one_file_per_model_dtype_and_forward_and_none_when_the_folder_is_empty(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CALIBRATION_DIR_ENV, str(tmp_path))
    device = torch.device("cpu")
    paths = {CalibrationStore.for_model(source, dtype, device, forward).path
             for source in ("a", "b") for dtype in (torch.float32, torch.bfloat16)
             for forward in ("eager", "packed", "compiled")}
    assert len(paths) == 12 and CalibrationStore.for_model("a", torch.float32, device).path in paths
    monkeypatch.setenv(CALIBRATION_DIR_ENV, "")
    assert CalibrationStore.for_model("a", torch.float32, device).path is None


def test_a_change_to_kvlabs_source_keeps_its_calibration_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "kvlab"
    (source / "cache").mkdir(parents=True)
    (source / "attention.py").write_text("SPLIT = 16\n")
    (source / "cache" / "layers.py").write_text("pass\n")
    before = source_digest(source)
    assert source_digest(source) == before  # the same source, the same file
    (source / "attention.py").write_text("SPLIT = 32\n")
    assert source_digest.__wrapped__(source) != before
    monkeypatch.setenv(CALIBRATION_DIR_ENV, str(tmp_path))
    kept = CalibrationStore.for_model("a", torch.float32, torch.device("cpu")).path
    monkeypatch.setattr(calibration, "source_digest", lambda: "another")
    assert CalibrationStore.for_model("a", torch.float32, torch.device("cpu")).path != kept


def test_a_cache_twice_as_long_as_any_calibrated_is_calibrated_again() -> None:
    costs = ForwardCostModel(warm_up=0)
    costs.observe_tick([("same", [SegmentShape(9, 120)], 0.02)], calibration=True)
    assert costs.calibration_covers("same", 200) and not costs.calibration_covers("same", 300)
    assert not costs.calibration_covers("int8", 10)
    costs.observe_tick([("same", [SegmentShape(1, 8000)], 0.03)])  # a live forward is not a calibration
    assert not costs.calibration_covers("same", 300)


def test_a_batch_calibration_keeps_the_faster_of_two_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    # A shared machine only ever adds time: one slow batch step would price plain ticks high for good.
    timings = iter([0.30, 0.25, 0.02, 0.03])
    monkeypatch.setattr(calibration_module, "_timed_packed", lambda model, caches, token_id, num_tokens: (
        next(timings), [SegmentShape(1, 1000) for _ in caches]))
    cache = types.SimpleNamespace(layers=[object()])
    costs = ForwardCostModel(warm_up=0)
    calibration_module.calibrate_batch(costs, {"same": torch.nn.Identity()}, [(cache, cache)] * 2, 5)  # type: ignore[list-item]
    assert [row[-1] for row in costs.calibration["same"]] == [0.25, 0.02]
