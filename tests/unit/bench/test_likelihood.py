"""The likelihood math on hand-made logits: KL(full || compressed), negative log-likelihood, perplexity."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.bench.likelihood import (
    kl_divergence,
    likelihood_figures,
    likelihood_means,
    perplexity,
    token_nll,
)


def test_kl_of_identical_logits_is_exactly_zero() -> None:
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kl_divergence(logits, logits.clone()), torch.zeros(5))


def test_kl_matches_the_hand_computed_value() -> None:
    # p = (1/4, 3/4), q = (1/2, 1/2): KL = 1/4 ln(1/2) + 3/4 ln(3/2).
    full = torch.tensor([[0.0, math.log(3.0)]])
    compressed = torch.tensor([[5.0, 5.0]])
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert kl_divergence(full, compressed).item() == pytest.approx(expected, abs=1e-7)


def test_kl_is_per_position_and_its_direction_is_full_first() -> None:
    full = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    compressed = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    forward, backward = kl_divergence(full, compressed), kl_divergence(compressed, full)
    assert forward[0].item() == 0.0, "identical rows give 0 at their own position"
    assert forward[1].item() == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-7)
    assert backward[1].item() == pytest.approx(0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0), abs=1e-7)


def test_kl_ignores_a_shift_of_every_logit_of_a_row() -> None:
    full = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    compressed = torch.randn(3, 7, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(kl_divergence(full, compressed), kl_divergence(full + 10.0, compressed - 3.0), atol=1e-5)


def test_kl_is_finite_where_neither_gives_mass_and_infinite_where_only_the_compressed_gives_none() -> None:
    full = torch.tensor([[0.0, -math.inf, 0.0]])
    assert kl_divergence(full, torch.tensor([[0.0, -math.inf, 0.0]])).item() == 0.0
    assert kl_divergence(full, torch.tensor([[0.0, 0.0, -math.inf]])).item() == math.inf


def test_kl_runs_in_float32_for_bfloat16_logits() -> None:
    full = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    compressed = torch.randn(4, 50, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    result = kl_divergence(full, compressed)
    p, q = torch.log_softmax(full.double(), -1), torch.log_softmax(compressed.double(), -1)
    expected = (p.exp() * (p - q)).sum(-1)
    assert result.dtype == torch.float32
    assert torch.allclose(result.double(), expected, atol=1e-5)


def test_kl_refuses_logits_of_different_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))


def test_perplexity_of_uniform_logits_is_the_vocabulary_size() -> None:
    assert perplexity(torch.zeros(6, 40), [1, 2, 3, 4, 5, 6]) == pytest.approx(40.0, rel=1e-6)


def test_perplexity_matches_the_hand_computed_value() -> None:
    # Token probabilities 1/2 and 1/8: exp(-(ln 1/2 + ln 1/8) / 2) = 4.
    logits = torch.log(torch.tensor([[0.5, 0.5, 0.0 + 1e-30], [0.125, 0.875, 1e-30]]))
    assert perplexity(logits, [0, 0]) == pytest.approx(4.0, rel=1e-6)
    assert token_nll(logits, [0, 1]).tolist() == pytest.approx([math.log(2.0), -math.log(0.875)], rel=1e-6)


def test_token_nll_refuses_a_token_count_other_than_the_rows() -> None:
    with pytest.raises(ValueError, match="3 token ids for 2 logit rows"):
        token_nll(torch.zeros(2, 5), [1, 2, 3])


def test_figures_of_one_continuation_score_each_cache_on_the_same_tokens() -> None:
    full = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    compressed = torch.zeros(2, 2)
    figures = likelihood_figures(full, compressed, [1, 0])
    assert figures.kl == pytest.approx((0.25 * math.log(0.5) + 0.75 * math.log(1.5)) / 2, abs=1e-7)
    assert figures.ppl == pytest.approx(2.0, rel=1e-6)
    assert figures.ppl_full == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.5)) / 2), rel=1e-6)
    assert figures.num_tokens == 2


def test_a_cells_figures_are_means_over_the_samples_that_have_them() -> None:
    records = [
        {"likelihood": {"kl": 0.1, "ppl": 2.0, "ppl_full": 1.5, "num_tokens": 4, "cache": "decoding"}},
        {"likelihood": None},
        {"likelihood": {"kl": 0.3, "ppl": 4.0, "ppl_full": 2.5, "num_tokens": 6, "cache": "decoding"}},
    ]
    summary = likelihood_means(records)
    assert summary is not None
    assert summary["kl"] == pytest.approx(0.2) and summary["ppl"] == pytest.approx(3.0)
    assert summary["ppl_full"] == pytest.approx(2.0)
    assert (summary["num_samples"], summary["num_tokens"], summary["cache"]) == (2, 10, "decoding")
    assert likelihood_means([{"likelihood": None}, {"id": "no figures"}]) is None
