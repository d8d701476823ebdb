"""The `kvlab` command: exit codes and one-line errors for bad input, listing."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvlab.cli import main


def test_ls_json_lists_models_and_registries(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [model["name"] for model in listing["models"]][:1] == ["smollm2"]
    assert listing["models"][0]["installed"] is True
    drafters = {drafter["name"]: drafter for drafter in listing["drafters"]}
    assert set(drafters) == {"compressed_cache", "prompt_lookup"}, drafters
    assert [param["name"] for param in drafters["compressed_cache"]["parameters"]] == ["draft_weights"]


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
        (
            ["--lossless", "--num-draft-tokens", "lots"],
            "argument --num-draft-tokens/--draft-length: expected int | 'auto'",
        ),
        (["--num-draft-tokens", "4"], "need --lossless"),
        (["--lossless", "--draft-length", "lots"], "argument --num-draft-tokens/--draft-length: expected int | 'auto'"),
        (
            ["--lossless", "--schedule", "later"],
            "argument --schedule: expected 'staggered' | 'synchronous', got 'later'",
        ),
        (["--max-new-tokens", "many"], "argument --max-new-tokens: expected int, got 'many'"),
        (["--max-new-tokens", "0"], "max_new_tokens must be at least 1"),
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


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlab import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvlab {__version__}"


@pytest.mark.parametrize(
    "argv",
    [["-v", "ls"], ["ls", "-v"], ["ls", "--verbose"], ["store", "ls", "-v", "memory://"], ["codec", "-v", "bench"]],
)
def test_verbose_is_accepted_before_and_after_the_subcommand(argv: list[str]) -> None:
    from kvlab.cli import build_parser

    parser, _ = build_parser()
    assert parser.parse_args(argv).verbose is True
    assert parser.parse_args(["ls"]).verbose is False


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--help"]) == 0
    assert "(default: 256)" in capsys.readouterr().out


def test_a_closed_pipe_is_not_a_failure() -> None:
    """`kvlab ls | head`: the reader is gone before kvlab writes (its end of the pipe is closed)."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvlab.cli", "ls"], stdout=write_end, stderr=subprocess.PIPE, text=True, check=False
        )
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert "BrokenPipe" not in done.stderr and "Traceback" not in done.stderr


def test_prompt_files_are_read_from_stdin_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from kvlab.cli.base import read_prompt_file

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("Ünïcode prompt".encode())))
    assert read_prompt_file(Path("-")) == "Ünïcode prompt"


def test_a_directory_is_not_a_prompt_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt-file", str(tmp_path)]) == 2
    assert "prompt file not found" in capsys.readouterr().err


@pytest.mark.parametrize(("device", "message"), [("cuda:7", "CUDA device"), ("tpu", "unknown device")])
def test_a_device_this_machine_lacks_is_a_usage_error(
    device: str,
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that many CUDA devices")
    assert main(["generate", "--prompt", "hi", "--device", device]) == 2
    assert message in capsys.readouterr().err


def test_streamed_text_holds_back_what_may_become_a_stop_string() -> None:
    import io

    from kvlab.cli.progress import TextStream

    out = io.StringIO()
    stream = TextStream(lambda tokens: "".join(chr(token) for token in tokens), ("STOP",), out)
    stream(1, [ord("x")])  # another request: not this stream's
    for chunk in ("Hel", "lo S", "T", "OP", " more"):
        stream(0, [ord(c) for c in chunk])
        assert "S" not in out.getvalue()  # "S", "ST", "STO" may start the stop string; "STOP" ends the text
    assert out.getvalue() == "Hello "
    stream.finish("Hello ")  # the output's text is cut before the stop string
    assert out.getvalue() == "Hello \n"


def test_streamed_text_waits_for_a_complete_character_and_calls_back_once() -> None:
    import io

    from kvlab.cli.progress import TextStream

    def decode(tokens: list[int]) -> str:  # tokens 2 and 3 are the two bytes of "é"
        tail = {(): "", (2,): "\ufffd", (2, 3): "é"}[tuple(tokens[1:])]
        return "a" + tail

    out, calls = io.StringIO(), []
    stream = TextStream(decode, (), out)
    stream.on_first = lambda: calls.append(1)
    stream(0, [1, 2])
    assert out.getvalue() == "a"
    stream(0, [3])
    assert out.getvalue() == "aé" and calls == [1]


@pytest.mark.parametrize(
    ("command", "config_path", "fields"),
    [
        ("generate", "kvlab.generation.config:GenerationConfig", "kvlab.cli.generate:GENERATION_FIELDS"),
        ("generate", "kvlab.lossless.config:LosslessConfig", "kvlab.cli.generate:LOSSLESS_FIELDS"),
        ("generate", "kvlab.store.prefix:PrefixConfig", "kvlab.cli.generate:PREFIX_FIELDS"),
    ],
)
def test_flags_take_their_help_and_defaults_from_the_config_fields(
    command: str, config_path: str, fields: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import dataclasses
    import importlib

    def load(path: str) -> Any:
        module, name = path.split(":")
        return getattr(importlib.import_module(module), name)

    config_class, names = load(config_path), load(fields)
    assert main([command, "--help"]) == 0
    text = "".join(capsys.readouterr().out.split())  # help wraps lines, also at hyphens
    for field in dataclasses.fields(config_class):
        if field.name in names:
            assert "".join(field.metadata["help"].split()) in text, field.name
            if field.default not in (None, False, (), dataclasses.MISSING):
                assert f"(default:{field.default})" in text, field.name


def test_demo_rejects_a_malformed_draft_length_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--prompt-file", "-", "--draft-length", "abc"]) == 2
    assert "expected int | 'auto', got 'abc'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["gnerate"], []])
def test_help_version_and_a_mistyped_command_answer_without_loading_torch(argv: list[str]) -> None:
    import subprocess

    code = (
        "import sys\nfrom kvlab.cli import main\n"
        f"status = main({argv!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "sys.exit(status)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert "torch was imported" not in result.stderr
    assert result.returncode == (0 if argv in (["--help"], ["--version"]) else 2), result.stderr
