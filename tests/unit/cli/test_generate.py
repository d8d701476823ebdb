"""`kvlab generate` on a tiny model saved to a folder: a failed request is exit 1 and one line naming the
error, never an answer; lossless output says whether it is exact, and `--lossless` says when it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvlab.cli import main
from kvlab.engine import tick as engine_module
from kvlab.lossless import config as lossless_config
from tests.helpers import tiny_llama

PROMPT = " ".join(f"w{(7 * i + 3) % 90 + 3}" for i in range(24))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-model")
    loaded = tiny_llama(num_kv_heads=2, seed=3, packed_weights=False)
    loaded.model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)
    return directory


def generate_argv(model_dir: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model_dir), "--raw", "--prompt", PROMPT, "--max-new-tokens", "6",
            "--ignore-eos", *extra]


@pytest.mark.parametrize("extra", [("--json",), (), ("--lossless", "--json")], ids=["json", "text", "lossless"])
def test_a_request_that_fails_exits_1_with_one_line_naming_the_error(
    tiny_model_dir: Path, extra: tuple[str, ...], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_batch = engine_module.run_batch
    calls = {"count": 0}

    def failing_second_forward(*args: Any, **kwargs: Any) -> Any:
        calls["count"] += 1
        if calls["count"] == 2:
            raise RuntimeError("device lost")
        return run_batch(*args, **kwargs)

    monkeypatch.delenv("KVLAB_DEBUG", raising=False)
    monkeypatch.setattr(engine_module, "run_batch", failing_second_forward)
    code = main(generate_argv(tiny_model_dir, *extra))
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 1, f"a failed request must exit 1, got {code}: {err}"
    assert len(err.splitlines()) == 1 and "kvlab generate: failed: RuntimeError: device lost" in err, err
    if "--json" in extra:
        assert captured.out == "", "no answer may be printed for a failed request"


@pytest.mark.parametrize(("dtype", "exact"), [("float32", True), ("bfloat16", False)])
def test_lossless_json_says_whether_the_output_is_exact(
    tiny_model_dir: Path, dtype: str, exact: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lossless_config, "_inexact_warned", True)  # the warning has its own tests
    assert main(generate_argv(tiny_model_dir, "--lossless", "--dtype", dtype, "--json")) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["lossless_exact"] is exact, f"{dtype}: lossless_exact is {stats.get('lossless_exact')!r}"


def test_the_lossless_help_states_the_float32_condition_next_to_the_promise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(identical greedy output in float32)" in text, "the group title promises with its condition"
    assert "greedy output equals plain decoding with --dtype float32 only" in text
    assert "bfloat16/float16" in text and "lossless_exact" in text
