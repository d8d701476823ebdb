"""Shared-context tasks: turns built from one article, compressed once at turn 1, reused through a prefix store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvlab.bench import BenchConfig, parse_method, run_benchmark
from kvlab.bench.multiturn import CompressedOnce, compressor_for_turn, shared_prefix_length
from kvlab.bench.results import PREDICTIONS_FILE, read_predictions
from kvlab.bench.tasks import tasks
from kvlab.compress import CompressionContext, create_compressor
from kvlab.errors import ConfigError
from tests.helpers import tiny_llama, tiny_tokenizer


def test_turns_share_the_document_and_carry_earlier_answers() -> None:
    task = tasks.create("multiturn_squad", context_tokens=200, num_turns=3)
    samples = task.load(tiny_tokenizer(), 6).samples
    assert [(s.extra["document"], s.extra["turn"]) for s in samples] == [
        ("0", 1), ("0", 2), ("0", 3), ("1", 1), ("1", 2), ("1", 3)
    ]  # fmt: skip
    first, second = samples[0], samples[1]
    question_1 = first.prompt.rsplit("Question: ", 1)[1]
    assert second.prompt.startswith(first.prompt), "turn 2 must extend turn 1's prompt"
    assert f"Question: {question_1}\nAnswer: {first.references[0]}\n\n" in second.prompt


def test_compressed_once_replays_the_first_turns_selection_and_keeps_every_later_token() -> None:
    generator = torch.Generator().manual_seed(0)
    queries, keys, values = (torch.randn(n, 40, 16, generator=generator) for n in (4, 2, 2))
    snapkv = create_compressor("snapkv", budget=12, window_size=4, kernel_size=3)
    selections: dict[int, torch.Tensor] = {}
    turn_1 = CompressedOnce(inner=snapkv, selections=selections)
    first = turn_1.compress(keys[:, :32], values[:, :32], CompressionContext(queries[:, :32], 0.25, 0))
    assert torch.equal(
        first.kept_indices,
        snapkv.compress(keys[:, :32], values[:, :32], CompressionContext(queries[:, :32], 0.25, 0)).kept_indices,
    )
    # Turn 2 shares 30 tokens with turn 1: turn 1's kept positions below 30, then all of 30..39.
    later = CompressedOnce(inner=snapkv, selections=selections, num_tokens=30).compress(
        keys, values, CompressionContext(queries[:, -5:], 0.25, 0)
    )
    expected_shared = [head[head < 30] for head in first.kept_indices]
    assert torch.equal(later.kept_indices[:, : len(expected_shared[0])], torch.stack(expected_shared))
    assert torch.equal(later.kept_indices[:, len(expected_shared[0]) :], torch.arange(30, 40).expand(2, 10))


def test_compressor_for_turn_wraps_eviction_only() -> None:
    snapkv, kivi = create_compressor("snapkv"), create_compressor("kivi", bits=2)
    assert compressor_for_turn(kivi, {}, [1, 2, 3], [1, 2, 9, 9]) is kivi
    wrapped = compressor_for_turn(snapkv, {}, [1, 2, 3], [1, 2, 9, 9])
    assert isinstance(wrapped, CompressedOnce) and wrapped.num_tokens == 2 == shared_prefix_length([1, 2, 3], [1, 2, 9])


def test_num_turns_is_validated() -> None:
    with pytest.raises(ConfigError, match="num_turns"):
        tasks.create("multiturn_squad", num_turns=1)


def test_runner_reports_quality_and_fidelity_per_turn(tmp_path: Path) -> None:
    config = BenchConfig(
        tasks=({"name": "multiturn_squad", "context_tokens": 300, "num_turns": 3, "max_new_tokens": 3},),
        methods=(parse_method("snapkv-75"), parse_method("snapkv_agnostic-75"), parse_method("lossless-snapkv-75")),
        samples=3,
        out=str(tmp_path),
        models=("tiny",),
        warmup=False,
    )
    cells = {cell["method"]: cell for cell in run_benchmark(config, loaded_models={"tiny": tiny_llama()})}
    for label, cell in cells.items():
        assert sorted(cell["per_turn"]) == ["1", "2", "3"], label
    # Lossless drafting from a cache compressed at turn 1 still reproduces full KV at every turn.
    assert all(turn["output_exact_match"] == 1.0 for turn in cells["lossless-snapkv-75"]["per_turn"].values())
    records = read_predictions(tmp_path / "tiny" / "multiturn_squad" / "lossless-snapkv-75" / PREDICTIONS_FILE)
    assert [record["turn"] for record in records] == [1, 2, 3]
    # Turn 1 runs without the store (its compressor sees every query); turn 2 saves; turn 3 restores.
    assert records[2]["stats"]["prefix_reused_tokens"] > 0, "turn 3 must restore turn 2's tokens from the store"
