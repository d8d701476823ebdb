"""Minimal, loop-based re-implementations of the eviction and merging methods, written from the
papers' equations, used as oracles for kvlab's vectorized versions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    weights = np.exp(shifted)
    return weights / weights.sum()


def attention_received(queries: np.ndarray, keys: np.ndarray, scaling: float, num_queries: int) -> np.ndarray:
    """[H_kv, T]: attention each key gets from the last `num_queries` queries (causal), summed over
    those queries and averaged over the query heads of each KV head."""
    num_heads, num_tokens = queries.shape[0], keys.shape[1]
    num_kv_heads = keys.shape[0]
    groups = num_heads // num_kv_heads
    received = np.zeros((num_kv_heads, num_tokens))
    for head in range(num_heads):
        kv_head = head // groups
        for position in range(num_tokens - num_queries, num_tokens):
            logits = keys[kv_head, : position + 1] @ queries[head, position] * scaling
            received[kv_head, : position + 1] += _softmax(logits) / groups
    return received


def top_indices(scores: np.ndarray, forced: np.ndarray, budget: int) -> np.ndarray:
    """Per head: forced tokens first, then the best scores, sorted ascending."""
    kept = []
    for head in range(scores.shape[0]):
        order = sorted(range(scores.shape[1]), key=lambda t: (not forced[t], -scores[head, t], t))
        kept.append(sorted(order[:budget]))
    return np.array(kept)


def snapkv_indices(queries, keys, scaling, window, kernel, pooling, budget) -> np.ndarray:  # type: ignore[no-untyped-def]
    received = attention_received(queries, keys, scaling, window)
    pad = kernel // 2
    prefix = received.shape[1] - window
    pooled = np.zeros_like(received)
    for head in range(received.shape[0]):
        for t in range(prefix):
            lo, hi = max(0, t - pad), min(prefix, t + pad + 1)
            segment = received[head, lo:hi]
            # avg_pool1d counts the zero padding in the divisor.
            pooled[head, t] = segment.max() if pooling == "max" else segment.sum() / kernel
    forced = np.zeros(keys.shape[1], dtype=bool)
    forced[-window:] = True
    return top_indices(pooled, forced, budget)


def h2o_indices(queries, keys, scaling, budget, recent_ratio) -> np.ndarray:  # type: ignore[no-untyped-def]
    received = attention_received(queries, keys, scaling, keys.shape[1])
    forced = np.zeros(keys.shape[1], dtype=bool)
    num_recent = int(budget * recent_ratio)
    if num_recent:
        forced[-num_recent:] = True
    return top_indices(received, forced, budget)


def streamingllm_indices(num_heads: int, num_tokens: int, num_sinks: int, budget: int) -> np.ndarray:
    kept = list(range(min(num_sinks, budget))) + list(range(num_tokens - (budget - min(num_sinks, budget)), num_tokens))
    return np.array([sorted(set(kept))] * num_heads)


@dataclass(frozen=True)
class CaMSettings:
    """CaM's hyper-parameters: attention sinks kept, token budget, merge span, observation window."""

    num_sinks: int
    budget: int
    span: int
    window: int


def cam_values(queries, keys, values, scaling, settings: CaMSettings) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    """CaM with the expected merge weight: returns (kept indices, kept merged values)."""
    num_sinks, budget, span, window = settings.num_sinks, settings.budget, settings.span, settings.window
    num_heads, num_tokens = keys.shape[0], keys.shape[1]
    kept = streamingllm_indices(num_heads, num_tokens, num_sinks, budget)
    attention = attention_received(queries, keys, scaling, window) / window
    merged = values.astype(np.float64).copy()
    for head in range(num_heads):
        kept_set = set(kept[head].tolist())
        mean_kept = np.mean([attention[head, t] for t in kept_set])
        for evicted in range(num_tokens):
            if evicted in kept_set:
                continue
            probability = min(1.0, attention[head, evicted] / mean_kept)
            for target in range(evicted + 1, min(num_tokens, evicted + 1 + span)):
                merged[head, target] += probability * merged[head, evicted] / span
    return kept, np.stack([merged[h, kept[h]] for h in range(num_heads)])

