"""Prefix reuse on the embedded model with a real document: restored prefixes change nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kvlab.cli import main
from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.engine import generate, generate_lossless
from kvlab.generation import GenerationConfig
from kvlab.generation.outputs import GenerationStats
from kvlab.generation.prefill import PrefillCaches, PrefixReuse, prefill
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel
from kvlab.store.prefix import PrefixCache, PrefixConfig

pytestmark = pytest.mark.integration

CHUNK = 256


@pytest.fixture(scope="module")
def document(embedded_model: LoadedModel) -> list[int]:
    return document_token_ids(embedded_model.tokenizer, 1200)


def test_fetched_prefix_then_continue_gives_the_logits_of_recompute(
    embedded_model: LoadedModel, document: list[int], redis_url: str
) -> None:
    prefix = PrefixCache.for_model(embedded_model, redis_url, PrefixConfig(CHUNK, allow_recompute=False))
    prefill(embedded_model, [document[:1100]], PrefillCaches(1200), PrefixReuse(prefix))
    prefix.close()
    prompt = document[:1030] + document[1100:1150]  # shares 4 chunks, then differs
    stats = GenerationStats()
    cache, _, logits = prefill(embedded_model, [prompt], PrefillCaches(1200), PrefixReuse(prefix, stats=stats))
    expected_cache, _, expected_logits = prefill(embedded_model, [prompt], PrefillCaches(1200), chunk_tokens=CHUNK)
    assert stats.prefix_reused_tokens == 4 * CHUNK
    assert torch.equal(logits, expected_logits)
    for layer, expected in zip(cache.layers, expected_cache.layers, strict=True):
        assert torch.equal(layer.stored(0)[0], expected.stored(0)[0])  # type: ignore[attr-defined]
        assert torch.equal(layer.stored(0)[1], expected.stored(0)[1])  # type: ignore[attr-defined]


def test_lossless_drafting_from_an_int4_prefix_is_identical(embedded_model: LoadedModel, document: list[int]) -> None:
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    expected = generate(embedded_model, [document[:1100]], config).requests[0].token_ids
    prefix = PrefixCache.for_model(
        embedded_model, "memory://", PrefixConfig(CHUNK, write=("exact", "int4"), allow_recompute=False)
    )
    generate(embedded_model, [document[:1100]], GenerationConfig(max_new_tokens=1), prefix=prefix)
    prefix.flush()
    spec = LosslessConfig(create_compressor("snapkv", compression_ratio=0.9), 8, prefix_draft="int4")
    output = generate_lossless(embedded_model, [document[:1100]], config, spec, prefix=prefix)
    assert output.requests[0].token_ids == expected
    assert output.stats.prefix_reused_tokens == 4 * CHUNK


def test_cli_reuses_a_prefix_across_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(Path("examples/long_prompt.txt").read_text()[:4000])
    command = ["generate", "--prompt-file", str(prompt), "--max-new-tokens", "8", "--json",
               "--prefix-store", f"file://{tmp_path / 'store'}"]
    assert main(command) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(command) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["token_ids"] == first["token_ids"]
    assert first["stats"]["prefix_reused_tokens"] == 0
    assert second["stats"]["prefix_reused_tokens"] == (len(first["prompt_token_ids"]) - 1) // CHUNK * CHUNK
    assert main(["store", "stats", f"file://{tmp_path / 'store'}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_keys"] == len(first["prompt_token_ids"]) // CHUNK


def test_cli_generates_when_the_store_is_down(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    command = ["generate", "--prompt", "Name a colour.", "--max-new-tokens", "4", "--json"]
    assert main(command) == 0
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        assert main([*command, "--prefix-store", "redis://127.0.0.1:9/0?timeout=0.2"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == expected


def test_cli_rejects_prefix_options_without_a_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--prompt", "x", "--prefix-resolutions", "int4"]) == 2
    assert "--prefix-store" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--prefix-store", "ftp://host/x"]) == 2
    assert main(["generate", "--prompt", "x", "--prefix-store", "memory://", "--prefix-resolutions", "int3"]) == 2
    assert main(["generate", "--prompt", "x", "--prefix-store", "memory://", "--prefix-draft", "int4"]) == 2
    assert main(["generate", "--prompt", "x", "--lossless", "--prefix-draft", "int4"]) == 2
    assert "--prefix-store" in capsys.readouterr().err.splitlines()[-1]


def test_cli_lossless_drafts_from_a_stored_low_bit_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(Path("examples/long_prompt.txt").read_text()[:4000])
    store = f"file://{tmp_path / 'store'}"
    lossless = ["generate", "--prompt-file", str(prompt), "--max-new-tokens", "12", "--json",
                "--prefix-store", store, "--lossless", "--prefix-draft", "int4"]
    assert main(lossless) == 0  # computes the prompt and fills the store (exact and int4 chunks)
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(lossless) == 0  # drafts from the int4 window, verifies on the exact prefix
    result = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == expected and result["stats"]["prefix_reused_tokens"] > 0
