"""The hostile corpus through the command line: `kvlab generate --prefix-store` and `kvlab codec decode`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvlab.cli import main
from kvlab.cli.codec import FRAMES_FORMAT
from kvlab.models import LoadedModel, load_model
from kvlab.store import ChunkSealer, create_store
from kvlab.store.prefix import PrefixCache, PrefixConfig
from tests.hostile.conftest import CASES, CHUNK, SECRET
from tests.hostile.corpus import FOREIGN, MALFORMED, hostile_chunks, hostile_frames

PROMPT = " ".join(f"w{(7 * i + 3) % 90 + 3}" for i in range(40))


def generate_json(
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    *extra: str,
) -> tuple[int, dict[str, object], str]:
    code = main(["generate", "--model", str(tiny_model_dir), "--raw", "--prompt", PROMPT, "--max-new-tokens", "6",
                 "--ignore-eos", "--json", *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else {}, captured.err


@pytest.mark.parametrize("case", CASES)
def test_generate_with_a_hostile_value_in_the_store_is_identical(
    tiny_model_dir: Path, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    if case == "swapped_chunk":
        monkeypatch.setenv("KVLAB_STORE_SECRET", SECRET.decode())
    url = f"file://{tmp_path / 'store'}"
    store_args = ("--prefix-store", url, "--prefix-chunk-tokens", str(CHUNK))
    code, expected, _ = generate_json(tiny_model_dir, capsys)
    assert code == 0
    assert generate_json(tiny_model_dir, capsys, *store_args)[0] == 0  # stores the prompt's chunks
    loaded = load_model(str(tiny_model_dir))
    planted = plant_in(loaded, url, case, loaded.encode_prompt(PROMPT, raw=True))
    caplog.clear()
    code, output, err = generate_json(tiny_model_dir, capsys, *store_args)
    assert code == 0, err
    assert output["token_ids"] == expected["token_ids"], f"{case}: output differs from recomputation"
    faults = [record.getMessage() for record in caplog.records if record.name == "kvlab.store"]
    assert len(faults) == 1 and planted in faults[0], faults
    assert "Traceback" not in err


def plant_in(loaded: LoadedModel, url: str, case: str, prompt: list[int]) -> str:
    """Replace chunk 1 of `prompt` in the store at `url` by `case`; returns its key."""
    sealer = ChunkSealer.from_environment()
    prefix = PrefixCache.for_model(loaded, url, PrefixConfig(chunk_tokens=CHUNK), sealer)
    store = create_store(url)
    key = prefix.keys(prompt, "exact")[1]
    if case == "swapped_chunk":
        other = prefix.keys(prompt[:CHUNK] + prompt[CHUNK:][::-1], "exact")[1]
        value = _sealed_other(prefix, prompt, other)
    else:
        fetched = prefix.fetch(prompt)
        keys, values = fetched.chunks[1]
        value = sealer.seal(key, hostile_chunks(keys, values)[case])
    store.put(key, value)
    return key


def _sealed_other(prefix: PrefixCache, prompt: list[int], other_key: str) -> bytes:
    """An authentic value of another chunk, sealed under its own key (what an outsider can copy)."""
    from kvlab.store.resolution import RESOLUTIONS, encode_chunk

    keys, values = prefix.fetch(prompt).chunks[1]
    return prefix.sealer.seal(other_key, encode_chunk(RESOLUTIONS["exact"], keys, values))


def frames_file(path: Path, frames: dict[str, bytes]) -> Path:
    tensors = {name: torch.frombuffer(bytearray(data), dtype=torch.uint8) for name, data in frames.items()}
    save_file(tensors, str(path), metadata={"format": FRAMES_FORMAT})
    return path


@pytest.mark.parametrize("case", MALFORMED)
def test_codec_decode_refuses_a_hostile_frame_with_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = frames_file(tmp_path / "frames.safetensors", {"keys": hostile_frames((3, 2, CHUNK, 16))[case]})
    assert main(["codec", "decode", str(source), str(tmp_path / "out.safetensors")]) == 1  # bad data: runtime failure
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tensor 'keys'" in err, err
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("case", FOREIGN)
def test_codec_decode_of_a_valid_foreign_frame_decodes_it(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a model to compare with, a well-formed frame of another geometry is just a tensor."""
    chunk = hostile_chunks(torch.randn(3, 2, CHUNK, 16), torch.randn(3, 2, CHUNK, 16))[case]
    key_frame = chunk[12 : 12 + int.from_bytes(chunk[4:12], "little")]
    source = frames_file(tmp_path / "frames.safetensors", {"keys": key_frame})
    assert main(["codec", "decode", str(source), str(tmp_path / "out.safetensors"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"][0]["tensor"] == "keys"


def test_codec_decode_refuses_frames_above_the_size_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab.codec import create_codec

    source = frames_file(tmp_path / "frames.safetensors", {"keys": create_codec("zstd").encode(torch.zeros(64, 64))})
    assert main(["codec", "decode", str(source), str(tmp_path / "out.safetensors"), "--max-tensor-bytes", "1000"]) == 1
    assert "above the limit of 1000" in capsys.readouterr().err


def test_a_full_disk_for_the_disk_tier_is_one_line_and_exit_1(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    def full_disk(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setenv("KVLAB_TIER_DIR", str(tmp_path / "tiers"))
    monkeypatch.setattr(os, "posix_fallocate", full_disk)
    code = main(["generate", "--model", str(tiny_model_dir), "--raw", "--prompt", PROMPT, "--max-new-tokens", "4",
                 "--full-kv-tier", "disk"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "No space left on device" in err[0], err
