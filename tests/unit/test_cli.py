"""The `kvlab` command: exit codes and one-line errors for bad input, listing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlab.cli import main


def test_ls_json_lists_models_and_registries(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [model["name"] for model in listing["models"]][:1] == ["smollm2"]
    assert listing["models"][0]["installed"] is True


def test_ls_text_lists_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls"]) == 0
    assert "smollm2" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--prompt", "   "], "the prompt is empty"),
        (["generate", "--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found"),
        (["generate", "--prompt", "hi", "--model", "no-such-org/no-such-model"], "not available locally"),
        (["generate", "--prompt", "hi", "--model", "./missing-model.gguf"], "no such model file"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
        (["generate", "--prompt", "hi", "--top-p", "1.5"], "top_p must be in"),
    ],
)
def test_bad_input_prints_one_line_and_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == [], "bad input must not write files"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate"]) == 2
    assert main(["generate", "--prompt", "a", "--prompt-file", "b"]) == 2
    assert main(["no-such-command"]) == 2


def test_non_utf8_prompt_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = tmp_path / "prompt.bin"
    prompt.write_bytes(b"\xff\xfe\x00bad")
    assert main(["generate", "--prompt-file", str(prompt)]) == 2
    assert "not UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lossless", "--drafter", "zipkv"], "unknown compressor 'zipkv'"),
        (["--lossless", "--num-draft-tokens", "0"], "num_draft_tokens must be a positive integer"),
        (["--lossless", "--num-draft-tokens", "lots"], "--num-draft-tokens must be a positive integer or 'auto'"),
        (["--num-draft-tokens", "4"], "need --lossless"),
        (["--lossless", "--draft-length", "lots"], "--num-draft-tokens must be a positive integer or 'auto'"),
        (["--full-kv-tier", "tape"], "full KV tier must be memory, host, disk or emulated:GBPS"),
        (["--full-kv-tier", "emulated:0"], "positive bandwidth"),
        (["--prefix-salt", "tenant-a"], "need --prefix-store"),
        (["--lossless", "--compressor", "kivi"], "with --lossless choose the drafter with --drafter"),
        (["--compressor-arg", "bits=2"], "--compressor-arg needs --compressor"),
    ],
)
def test_bad_lossless_options_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "hi", *argv]) == 2
    assert message in capsys.readouterr().err
