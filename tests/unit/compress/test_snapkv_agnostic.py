"""Query-agnostic SnapKV: its selection ignores the prompt's last window (the question)."""

from __future__ import annotations

import math

import numpy as np
import torch

from kvlab.compress import CompressionContext, create_compressor
from kvlab.compress.snapkv_agnostic import attention_from_positions, observation_positions

SCALING = 1 / math.sqrt(16)


def _qkv(seed: int, tokens: int = 48) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(4, tokens, 16, generator=generator)  # 2 KV heads x 2 query heads each
    keys = torch.randn(2, tokens, 16, generator=generator)
    values = torch.randn(2, tokens, 16, generator=generator)
    return queries, keys, values


def _kept(name: str, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    compressor = create_compressor(name, budget=20, window_size=8, kernel_size=3)
    return compressor.compress(keys, values, CompressionContext(queries, SCALING, 0)).kept_indices


def test_new_question_queries_leave_the_selection_unchanged() -> None:
    queries, keys, values = _qkv(0)
    other_question = queries.clone()
    other_question[:, -8:] = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(99))
    assert torch.equal(
        _kept("snapkv_agnostic", queries, keys, values), _kept("snapkv_agnostic", other_question, keys, values)
    )
    # SnapKV itself reads exactly those queries, so the same change moves its selection.
    assert not torch.equal(_kept("snapkv", queries, keys, values), _kept("snapkv", other_question, keys, values))


def test_last_window_is_kept_within_the_budget() -> None:
    queries, keys, values = _qkv(1)
    kept = _kept("snapkv_agnostic", queries, keys, values)
    assert kept.shape == (2, 20)
    for head in range(2):
        assert set(range(40, 48)) <= set(kept[head].tolist()), f"head {head} dropped part of the last window"


def test_observation_positions_spread_over_the_context() -> None:
    assert observation_positions(40, 5, "cpu").tolist() == [0, 10, 20, 29, 39]
    assert observation_positions(3, 8, "cpu").tolist() == [0, 1, 2]


def test_attention_from_positions_matches_a_loop() -> None:
    queries, keys, _ = _qkv(2, tokens=20)
    positions = torch.tensor([0, 7, 19])
    received = attention_from_positions(queries[:, positions], keys, positions, SCALING).numpy()
    expected = np.zeros((2, 20))
    for head in range(4):
        for position in positions.tolist():
            logits = keys[head // 2, : position + 1].numpy() @ queries[head, position].numpy() * SCALING
            weights = np.exp(logits - logits.max())
            expected[head // 2, : position + 1] += weights / weights.sum() / 2
    np.testing.assert_allclose(received, expected, rtol=1e-5, atol=1e-6)
