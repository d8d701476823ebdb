"""Log-likelihood figures of a compressed cache against the full one: pure functions of logits.

The measure of KIVI and TurboQuant: teacher-force one continuation (the full-KV greedy output) through
both caches and compare, position by position, the next-token distributions they give. `kl_divergence`
is KL(full || compressed) of those distributions, `perplexity` the exponentiated mean negative
log-likelihood of the continuation's tokens. Every log-softmax runs in float32, whatever the logits'
dtype, so bf16 models are compared on the same footing as fp32 ones.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """[T, V] float32 log-probabilities of [T, V] logits (any float dtype)."""
    return torch.log_softmax(logits.float(), dim=-1)


def kl_divergence(full_logits: torch.Tensor, compressed_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(full || compressed) of the next-token distributions, in nats.

    Args:
        full_logits: [T, V] logits from the full cache (the reference distribution p).
        compressed_logits: [T, V] logits from the compressed cache at the same positions (q).

    Returns:
        [T] float32 `sum_v p(v) (log p(v) - log q(v))`. A token p gives no mass adds nothing (even
        where q gives none either); one q gives no mass while p does makes it `inf`. Rounding can
        leave a value a few ulps below zero when p and q nearly agree; it is clamped to 0 (KL >= 0).
    """
    if full_logits.shape != compressed_logits.shape or full_logits.dim() != 2:
        shapes = f"{tuple(full_logits.shape)} and {tuple(compressed_logits.shape)}"
        raise ValueError(f"expected two [T, V] logits of one shape, got {shapes}")
    full, compressed = log_probs(full_logits), log_probs(compressed_logits)
    probs = full.exp()
    terms = torch.where(probs > 0, probs * (full - compressed), torch.zeros_like(probs))
    return terms.sum(dim=-1).clamp_min(0.0)


def token_nll(logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[T] float32 negative log-likelihood of `token_ids` [T], position t scored by row t of `logits` [T, V]."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=logits.device)
    if ids.shape != logits.shape[:1]:
        raise ValueError(f"{ids.numel()} token ids for {logits.shape[0]} logit rows")
    return -log_probs(logits).gather(-1, ids[:, None])[:, 0]


def perplexity(logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int]) -> float:
    """exp(mean negative log-likelihood) of `token_ids` [T] under `logits` [T, V] (T >= 1)."""
    if logits.shape[0] == 0:
        raise ValueError("perplexity of an empty continuation")
    return math.exp(float(token_nll(logits, token_ids).mean()))


@dataclasses.dataclass(frozen=True, slots=True)
class LikelihoodFigures:
    """One sample's continuation scored under the full cache and a compressed one.

    Attributes:
        kl: Mean over the continuation's positions of KL(full || compressed), nats per token.
        ppl: Perplexity of the continuation under the compressed cache.
        ppl_full: Perplexity of the same continuation under the full cache.
        num_tokens: Tokens scored (the continuation's length).
    """

    kl: float
    ppl: float
    ppl_full: float
    num_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def likelihood_figures(
    full_logits: torch.Tensor, compressed_logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int]
) -> LikelihoodFigures:
    """The figures of one continuation `token_ids` [T], from its [T, V] full and compressed logits.

    Row t of both logits is the distribution of token t given the prompt and tokens 0..t-1.
    """
    return LikelihoodFigures(
        kl=float(kl_divergence(full_logits, compressed_logits).mean()),
        ppl=perplexity(compressed_logits, token_ids),
        ppl_full=perplexity(full_logits, token_ids),
        num_tokens=int(full_logits.shape[0]),
    )


LIKELIHOOD_KEYS = ("kl", "ppl", "ppl_full")


def likelihood_means(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """A cell's figures: the mean over its samples of each sample's `kl`, `ppl` and `ppl_full`.

    Records without figures (measurement off, or no full-KV continuation to score) are left out;
    None when no record has them. `cache` says whose cache was scored ("decoding": the one lossy
    decoding reads; "drafter": a lossless row's draft cache, its output being full KV's).
    """
    scored = [record["likelihood"] for record in records if record.get("likelihood")]
    if not scored:
        return None
    summary: dict[str, Any] = {key: statistics.fmean(figures[key] for figures in scored) for key in LIKELIHOOD_KEYS}
    summary["num_samples"] = len(scored)
    summary["num_tokens"] = sum(figures["num_tokens"] for figures in scored)
    summary["cache"] = scored[0].get("cache", "decoding")
    return summary
