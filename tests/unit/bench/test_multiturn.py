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
from tests.conftest import tiny_llama, tiny_tokenizer


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


def test_compressed_once_keeps_the_first_turns_selection_and_every_later_token() -> None:
    generator = torch.Generator().manual_seed(0)
    queries, keys, values = (torch.randn(n, 40, 16, generator=generator) for n in (4, 2, 2))
    snapkv = create_compressor("snapkv", budget=12, window_size=4, kernel_size=3)
    context = CompressionContext(queries, 0.25, 0)
    at_turn_1 = snapkv.compress(keys[:, :30], values[:, :30], CompressionContext(queries[:, :30], 0.25, 0))
    later = CompressedOnce(inner=snapkv, num_tokens=30).compress(keys, values, context)
    assert later.kept_indices.shape == (2, 12 + 10)
    assert torch.equal(later.kept_indices[:, :12], at_turn_1.kept_indices)
    assert torch.equal(later.kept_indices[:, 12:], torch.arange(30, 40).expand(2, 10))


def test_compressor_for_turn_wraps_eviction_only_after_turn_1() -> None:
    snapkv, kivi = create_compressor("snapkv"), create_compressor("kivi", bits=2)
    assert compressor_for_turn(snapkv, [1, 2, 3], [1, 2, 3]) is snapkv
    assert compressor_for_turn(kivi, [1, 2, 3], [1, 2, 9, 9]) is kivi
    wrapped = compressor_for_turn(snapkv, [1, 2, 3], [1, 2, 9, 9])
    assert isinstance(wrapped, CompressedOnce) and wrapped.num_tokens == 2 == shared_prefix_length([1, 2, 3], [1, 2, 9])


def test_num_turns_is_validated() -> None:
    with pytest.raises(ConfigError, match="num_turns"):
        tasks.create("multiturn_squad", num_turns=1)


def test_runner_reports_quality_and_fidelity_per_turn(tmp_path: Path) -> None:
    config = BenchConfig(
        tasks=({"name": "multiturn_squad", "context_tokens": 300, "num_turns": 2, "max_new_tokens": 3},),
        methods=(parse_method("snapkv-75"), parse_method("lossless-snapkv-75")),
        samples=2,
        out=str(tmp_path),
        models=("tiny",),
        warmup=False,
    )
    cells = {cell["method"]: cell for cell in run_benchmark(config, loaded_models={"tiny": tiny_llama()})}
    for label, cell in cells.items():
        assert sorted(cell["per_turn"]) == ["1", "2"], label
    # Lossless drafting from a cache compressed at turn 1 still reproduces full KV at every turn.
    assert all(turn["output_exact_match"] == 1.0 for turn in cells["lossless-snapkv-75"]["per_turn"].values())
    records = read_predictions(tmp_path / "tiny" / "multiturn_squad" / "lossless-snapkv-75" / PREDICTIONS_FILE)
    assert [record["turn"] for record in records] == [1, 2]
    assert records[1]["stats"]["prefix_reused_tokens"] > 0, "turn 2 must restore turn 1's tokens from the store"
