"""Attention of new queries over the keys/values a cache layer stores (pure functions).

Stored keys carry their true sequence positions, so the same code serves a full cache (position ==
index), a batch whose rows hold different lengths, a sliding window, and later an evicted cache
whose positions have gaps. When the mask is trivial the call matches transformers' own SDPA call
exactly (same kernel, same arguments), which is what makes kvlab's logits bit-identical to the
plain model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: torch.Tensor,
    key_lengths: list[int],
    scaling: float,
    key_positions: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of `q` new queries per row over stored keys.

    Args:
        queries: [B, H, q, D], rotary already applied.
        keys: [B, H_kv, T, D], stored keys (rows may be valid only up to `key_lengths[b]`).
        values: [B, H_kv, T, D].
        query_positions: [B, q] int64, the true sequence position of each query.
        key_lengths: Valid stored keys per row (len B, each <= T); the newest keys are the queries' own.
        scaling: Softmax scale.
        key_positions: [B, T] int64 true positions of the stored keys, or None when position == index.
        sliding_window: Keys at least this many positions behind a query are invisible; pass None when
            no query is that far along (the caller knows the positions without a device sync).

    Returns:
        [B, H, q, D] attention output in the queries' dtype.
    """
    num_queries, num_keys = queries.shape[2], keys.shape[2]
    gqa = queries.shape[1] != keys.shape[1]
    uniform = key_positions is None and all(length == num_keys for length in key_lengths)
    if uniform and sliding_window is None:
        if num_queries == 1:
            return F.scaled_dot_product_attention(queries, keys, values, scale=scaling, enable_gqa=gqa)
        if num_queries == num_keys:
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scaling, enable_gqa=gqa)
        if 2 * num_queries > num_keys and _queries_are_newest_keys(query_positions, num_keys):
            return _padded_causal(queries, keys, values, scaling, gqa)
    mask = visibility_mask(query_positions, key_lengths, num_keys, key_positions, sliding_window)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def visibility_mask(
    query_positions: torch.Tensor,
    key_lengths: list[int],
    num_keys: int,
    key_positions: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Boolean mask [B, 1, q, T]: True where query i of row b may attend stored key j.

    A key is visible when it is stored (j < key_lengths[b]), not in the query's future, and, with a
    sliding window, fewer than `sliding_window` positions behind the query.
    """
    device = query_positions.device
    index = torch.arange(num_keys, device=device)
    positions = index.expand(len(key_lengths), num_keys) if key_positions is None else key_positions
    stored = index[None, :] < torch.tensor(key_lengths, device=device)[:, None]  # [B, T]
    visible = (positions[:, None, :] <= query_positions[:, :, None]) & stored[:, None, :]  # [B, q, T]
    if sliding_window is not None:
        visible &= positions[:, None, :] > query_positions[:, :, None] - sliding_window
    return visible[:, None]


def _queries_are_newest_keys(query_positions: torch.Tensor, num_keys: int) -> bool:
    """Whether query i of every row sits at key index `num_keys - q + i` (a prefill continuing a cache)."""
    expected = torch.arange(num_keys - query_positions.shape[1], num_keys, device=query_positions.device)
    return bool((query_positions == expected).all())


def _padded_causal(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, gqa: bool
) -> torch.Tensor:
    """Causal attention of the newest q of T keys' queries, through the square causal kernel.

    Measured on CPU: an explicit mask makes the kernel visit every key block of every query (the whole
    T x q rectangle), while `is_causal` skips blocks above the diagonal. Zero queries in front make the
    problem square; each query row's result does not depend on the other rows, so the output has the
    bits of a prefill that computed all T tokens at once (the prefix-reuse equality tests rely on it).
    Worth it once q > T / 2 (the square's triangle is then smaller than the rectangle).
    """
    batch, heads, num_queries, dim = queries.shape
    padding = queries.new_zeros(batch, heads, keys.shape[2] - num_queries, dim)
    padded = torch.cat([padding, queries], dim=2)
    output = F.scaled_dot_product_attention(padded, keys, values, is_causal=True, scale=scaling, enable_gqa=gqa)
    return output[:, :, -num_queries:]
