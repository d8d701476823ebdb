"""`kvlab codec encode/decode` on safetensors files, one-line errors, and the bench library."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvlab.bench.codec import BenchCase, bench_codecs
from kvlab.cli import main
from kvlab.codec.layouts import integer_view
from tests.unit.codec.matrix import random_kv


@pytest.fixture
def kv_file(tmp_path: Path) -> Path:
    path = tmp_path / "kv.safetensors"
    save_file({"layers.0.keys": random_kv((3, 40, 16)), "layers.0.values": random_kv((3, 40, 16), seed=1)}, str(path))
    return path


def test_encode_then_decode_is_bit_exact(kv_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frames, restored = tmp_path / "kv.kvc", tmp_path / "restored.safetensors"
    assert main(["codec", "encode", str(kv_file), str(frames), "--codec", "byteplane"]) == 0
    assert main(["codec", "decode", str(frames), str(restored)]) == 0
    original, decoded = load_file(str(kv_file)), load_file(str(restored))
    assert sorted(decoded) == sorted(original)
    for name, tensor in original.items():
        assert (integer_view(decoded[name]) == integer_view(tensor)).all(), name
    assert "layers.0.keys" in capsys.readouterr().out


def test_quantized_codecs_take_the_kind_from_the_tensor_name(kv_file: Path, tmp_path: Path) -> None:
    frames, restored = tmp_path / "kv.kvc", tmp_path / "restored.safetensors"
    assert main(["codec", "encode", str(kv_file), str(frames), "--codec", "quant_zstd", "--set", "bits=4"]) == 0
    assert main(["codec", "decode", str(frames), str(restored)]) == 0
    decoded = load_file(str(restored))
    assert decoded["layers.0.keys"].shape == (3, 40, 16)


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str], code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_inputs_print_one_line_and_exit_2(
    kv_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = str(tmp_path / "out")
    assert "not found" in one_line_error(["codec", "encode", str(tmp_path / "missing"), out], capsys)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert "not a readable safetensors" in one_line_error(["codec", "encode", str(junk), out], capsys)
    assert "unknown codec" in one_line_error(["codec", "encode", str(kv_file), out, "--codec", "nope"], capsys)
    assert "kvlab codec encode" in one_line_error(["codec", "decode", str(kv_file), out], capsys)
    ambiguous = tmp_path / "x.safetensors"
    save_file({"x": random_kv((2, 4, 4))}, str(ambiguous))
    assert "keys or values" in one_line_error(["codec", "encode", str(ambiguous), out, "--codec", "cachegen"], capsys)
    assert not Path(out).exists(), "bad input must not write files"


def test_a_corrupted_frames_file_is_a_one_line_error(kv_file: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    frames = tmp_path / "kv.kvc"
    assert main(["codec", "encode", str(kv_file), str(frames), "--codec", "zstd"]) == 0
    tensors = load_file(str(frames))
    tensors["layers.0.values"][-3] ^= 0x10
    save_file(tensors, str(frames), metadata={"format": "kvlab-codec-frames"})
    # Bad data is a runtime failure (exit 1), not a usage error.
    err = one_line_error(["codec", "decode", str(frames), str(tmp_path / "out")], capsys, code=1)
    assert "layers.0.values" in err and "checksum" in err


def test_output_into_a_missing_directory_is_refused_before_any_work(
    kv_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "out.kvc"
    assert "does not exist" in one_line_error(["codec", "encode", str(kv_file), str(missing)], capsys)
    assert "does not exist" in one_line_error(["codec", "decode", str(kv_file), str(missing)], capsys)


def test_bench_refuses_a_context_longer_than_the_model_s(capsys: pytest.CaptureFixture[str]) -> None:
    assert "exceeds" in one_line_error(["codec", "bench", "--context", "100000"], capsys)


def test_bench_reports_ratio_speed_and_error_per_codec() -> None:
    keys, values = random_kv((2, 2, 300, 32)), random_kv((2, 2, 300, 32), seed=3)
    cases = [BenchCase("raw", "raw"), BenchCase("byteplane", "byteplane"), BenchCase("q4", "quant_zstd", {"bits": 4})]
    results = {r.label: r for r in bench_codecs(keys, values, cases)}
    assert all(r.verified for r in results.values())
    assert results["raw"].kv_bytes_ratio < 1.0 < results["byteplane"].kv_bytes_ratio < results["q4"].kv_bytes_ratio
    assert results["raw"].max_abs_error == 0.0 < results["q4"].max_abs_error
    assert (results["raw"].lossless, results["q4"].lossless) == ("bit-exact", "codes")
    assert results["q4"].num_values == keys.numel() + values.numel()
    assert torch.isfinite(torch.tensor(results["q4"].bits_per_value))


def test_encode_json_reports_bits_per_value_and_kv_bytes_ratio(
    kv_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    frames = tmp_path / "kv.kvc"
    assert main(
        ["codec", "encode", str(kv_file), str(frames), "--codec", "quant_zstd", "--set", "bits=4", "--json"]
    ) == 0
    rows = json.loads(capsys.readouterr().out)["tensors"]
    for row in rows:
        num_values = 3 * 40 * 16
        assert row["bits_per_value"] == pytest.approx(8 * row["bytes"] / num_values)
        assert row["kv_bytes_ratio"] == pytest.approx(2 * num_values / row["bytes"])
        assert "ratio" not in row
