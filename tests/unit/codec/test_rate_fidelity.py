"""Rate against fidelity: the coders of one bit width, the entropy bound, the tables and the plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvlab.bench.codec import bench_codecs
from kvlab.bench.codec.fidelity import (
    RATE_BITS,
    RESOLUTION_OF_BITS,
    EntropyBound,
    RateFidelityReport,
    TaskFidelity,
    entropy_bounds,
    rate_cases,
)
from kvlab.bench.codec.plot import save_rate_fidelity_plot
from kvlab.bench.codec.report import rate_fidelity_tables
from kvlab.codec import codecs, create_codec
from kvlab.codec.prediction import channel_contexts, entropy_bits, token_residuals, undo_token_residuals
from kvlab.store.resolution import RESOLUTIONS
from tests.unit.cli.test_codec import one_line_error
from tests.unit.codec.matrix import random_kv


def test_every_code_lossless_codec_is_benched_at_every_bit_width() -> None:
    code_lossless = {name for name in codecs.names() if create_codec(name).lossless == "codes"}
    cases = rate_cases()
    for bits in RATE_BITS:
        benched = {case.codec for case in cases if case.params["bits"] == bits}
        assert benched == code_lossless, f"{bits}-bit rows miss {code_lossless - benched}"
    assert all(RESOLUTIONS[RESOLUTION_OF_BITS[bits]].lossless == "codes" for bits in RATE_BITS)


def test_every_coder_of_one_bit_width_restores_the_same_tensor() -> None:
    keys, values = random_kv((2, 2, 70, 16)), random_kv((2, 2, 70, 16), seed=1)
    cases = [case for case in rate_cases([2]) if case.codec != "cachegen" or "context" not in case.params]
    rows = bench_codecs(keys, values, cases)
    assert all(row.verified for row in rows)
    assert len({row.rms_error for row in rows}) == 1, {row.label: row.rms_error for row in rows}
    decoded = [create_codec(c.codec, kind="keys", **c.params).reconstruct(keys).view(torch.int16) for c in cases]
    assert all(torch.equal(decoded[0], other) for other in decoded[1:])


def test_entropy_of_uniform_and_determined_symbols() -> None:
    symbols = np.tile(np.arange(4), 256)
    assert entropy_bits(symbols) == pytest.approx(2.0)
    assert entropy_bits(symbols, contexts=symbols) == pytest.approx(0.0)


def test_residuals_undo_exactly_and_a_slow_ramp_has_low_residual_entropy() -> None:
    ramp = (np.arange(200)[None, :, None] // 3 % 16).astype(np.uint8).repeat(4, axis=2)
    residuals = token_residuals(ramp, 4)
    assert np.array_equal(undo_token_residuals(residuals, 4), ramp)
    contexts = channel_contexts(ramp.shape)
    assert entropy_bits(residuals, contexts) < 1.0 < entropy_bits(ramp, contexts)


def test_bounds_count_metadata_and_take_the_better_of_codes_and_residuals() -> None:
    keys, values = random_kv((2, 2, 256, 16)), random_kv((2, 2, 256, 16), seed=1)
    for bound in entropy_bounds(keys, values, [2, 4]):
        # keys: 32 bits per 128 tokens; values: 32 bits per token of 16 channels
        assert bound.metadata == pytest.approx((32 / 128 + 32 / 16) / 2)
        assert bound.best_bits_per_value >= min(bound.codes, bound.residuals) + bound.metadata - 1e-9
        assert bound.kv_bytes_ratio == pytest.approx(16 / bound.best_bits_per_value)


def synthetic_report() -> RateFidelityReport:
    keys, values = random_kv((2, 2, 64, 16)), random_kv((2, 2, 64, 16), seed=1)
    cases = [case for case in rate_cases([4, 2]) if case.codec == "quant_zstd"]
    return RateFidelityReport(
        rates=bench_codecs(keys, values, cases),
        bounds=entropy_bounds(keys, values, [4, 2]),
        fidelity=[TaskFidelity(4, "int4-video", 3, 1.0, 1.0, 768), TaskFidelity(2, "int2-video", 3, 0.0, 0.25, 768)],
        tasks=["niah"],
    )


def test_tables_show_every_row_the_bound_and_the_task_columns() -> None:
    report = synthetic_report()
    text = rate_fidelity_tables(report)
    assert all(row.label in text for row in report.rates)
    assert "1.3 bits/value" in text and "int2-video" in text and "25%" in text
    assert isinstance(report.bounds[0], EntropyBound)


def test_the_plot_is_written(tmp_path: Path) -> None:
    path = save_rate_fidelity_plot(synthetic_report(), tmp_path / "rate.png", "synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("bits", "message"), [("5", "must list values from"), ("x", "comma-separated integers")])
def test_bad_bit_widths_are_usage_errors(bits: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in one_line_error(["codec", "bench", "--rate-fidelity", "--bits", bits], capsys)
