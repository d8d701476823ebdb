"""Codecs on the embedded SmolLM2's real KV (384 tokens): bit-exact, code-lossless, streamed, benched."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from kvlab.bench.codec import collect_kv
from kvlab.bench.codec.fidelity import task_fidelity
from kvlab.cli import main
from kvlab.codec import StreamDecoder, create_codec
from kvlab.codec.layouts import integer_view
from kvlab.models import LoadedModel

pytestmark = pytest.mark.integration

NUM_TOKENS = 384


@pytest.fixture(scope="module")
def real_kv(embedded_model: LoadedModel) -> tuple[torch.Tensor, torch.Tensor]:
    return collect_kv(embedded_model, NUM_TOKENS)


def test_kv_has_the_model_geometry(real_kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    keys, values = real_kv
    assert keys.shape == values.shape == (30, 3, NUM_TOKENS, 64) and keys.dtype == torch.float16


@pytest.mark.parametrize("name", ["byteplane", "zstd"])
def test_bit_exact_codecs_round_trip_real_kv(name: str, real_kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    codec = create_codec(name)
    for label, tensor in zip(("keys", "values"), real_kv, strict=True):
        decoded = codec.decode(codec.encode(tensor))
        assert (integer_view(decoded) == integer_view(tensor)).all(), f"{name} changed bits of the {label}"


def test_byteplane_beats_plain_zstd_on_real_kv(real_kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    sizes = {name: sum(len(create_codec(name).encode(t)) for t in real_kv) for name in ("byteplane", "zstd")}
    fp16_bytes = 2 * sum(t.numel() for t in real_kv)
    assert fp16_bytes / sizes["byteplane"] > 1.15 > fp16_bytes / sizes["zstd"], sizes


@pytest.mark.parametrize("name", ["quant_zstd", "cachegen"])
def test_code_lossless_codecs_reproduce_the_dequantized_kv(
    name: str, real_kv: tuple[torch.Tensor, torch.Tensor]
) -> None:
    for kind, tensor in zip(("keys", "values"), real_kv, strict=True):
        layer = tensor[:4]
        codec = create_codec(name, kind=kind, bits=4)
        decoded = codec.decode(codec.encode(layer))
        assert (integer_view(decoded) == integer_view(codec.reconstruct(layer))).all(), f"{name} {kind}"


def test_streamed_real_kv_equals_whole_decode(real_kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    keys = real_kv[0]
    codec = create_codec("byteplane", chunk_tokens=64)
    data = codec.encode(keys)
    decoder = StreamDecoder(io.BytesIO(data))
    restored = decoder.restore(torch.empty_like(keys))
    assert torch.equal(restored.view(torch.int16), codec.decode(data).view(torch.int16))
    one_chunk = keys.shape[0] * keys.shape[1] * 64 * keys.shape[3] * keys.element_size()
    assert decoder.peak_buffer_bytes <= 2 * one_chunk < keys.numel() * keys.element_size()


def test_bench_command_prints_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["codec", "bench", "--context", "32", "--codecs", "raw,quant_zstd", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv_shape"] == [30, 3, 32, 64]
    rows = {row["label"]: row for row in report["results"]}
    assert set(rows) == {"raw", "quant_zstd 8-bit", "quant_zstd 4-bit", "quant_zstd 2-bit"}
    assert all(row["verified"] for row in rows.values())
    assert rows["raw"]["max_abs_error"] == 0.0 and rows["quant_zstd 4-bit"]["lossless"] == "codes"


@pytest.mark.parametrize("video_format", ["hevc", "ffv1"])
def test_video_coded_codes_of_real_kv_come_back_identical(
    video_format: str, real_kv: tuple[torch.Tensor, torch.Tensor]
) -> None:
    for kind, tensor in zip(("keys", "values"), real_kv, strict=True):
        layers = tensor[:4]
        codec = create_codec("video_codes", kind=kind, bits=2, format=video_format, hardware="never")
        decoded = codec.decode(codec.encode(layers))
        assert (integer_view(decoded) == integer_view(codec.reconstruct(layers))).all(), f"{video_format} {kind}"


def test_rate_fidelity_command_reports_every_coder_the_bound_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "rate.png"
    argv = ["codec", "bench", "--rate-fidelity", "--context", "64", "--bits", "2", "--samples-per-task", "0",
            "--plot", str(plot), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert {row["codec"] for row in report["results"]} == {"quant_zstd", "cachegen", "video_codes"}
    assert all(row["verified"] and row["kv_bytes_ratio"] > 1 for row in report["results"])
    assert [bound["bits"] for bound in report["bounds"]] == [2] and report["fidelity"] == []
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_task_fidelity_decodes_from_a_prefix_restored_through_the_store(embedded_model: LoadedModel) -> None:
    specs = (("variable_tracking", {"context_tokens": 300}),)
    (row,) = task_fidelity(
        embedded_model, specs, samples_per_task=1, bits_list=(8,), max_new_tokens=6, chunk_tokens=128
    )
    assert (row.bits, row.resolution, row.num_prompts) == (8, "int8", 1)
    assert row.reused_tokens >= 128, "the prefix must come from the store"
    assert 0.0 <= row.matched_prefix <= 1.0 and row.identical in (0.0, 1.0)


def test_capture_then_encode_then_decode_gives_back_the_captured_kv_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"A prompt about caches, read from stdin.")))
    captured, frames, decoded = (
        tmp_path / "kv.safetensors",
        tmp_path / "frames.safetensors",
        tmp_path / "out.safetensors",
    )
    assert main(["codec", "capture", str(captured), "--prompt-file", "-", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    kv = load_file(str(captured))
    assert list(kv["keys"].shape) == summary["shape"] == list(kv["values"].shape)
    assert summary["shape"][0] == 30 and summary["shape"][2] < 32  # every layer, the prompt's own tokens
    assert main(["codec", "encode", str(captured), str(frames), "--codec", "byteplane"]) == 0
    assert main(["codec", "decode", str(frames), str(decoded)]) == 0
    restored = load_file(str(decoded))
    assert all(torch.equal(restored[name].view(torch.int16), kv[name].view(torch.int16)) for name in ("keys", "values"))


def test_capture_into_a_missing_directory_is_a_usage_error(tmp_path: Path) -> None:
    assert main(["codec", "capture", str(tmp_path / "no" / "kv.safetensors")]) == 2
