"""Attention of new queries over the keys/values a cache layer stores (pure functions).

The ground floor under both `kvlab.models` (the attention hook's soft-capped path) and `kvlab.cache`
(every cache layer attends through it), so neither imports the other for it.

Stored keys carry their true sequence positions, so `attend` serves a full cache (position == index), a
batch whose rows hold different lengths, a sliding window, and an evicted cache whose positions have gaps.
When the mask is trivial the call matches transformers' own SDPA call exactly (same kernel, same
arguments), which is what makes kvlab's logits bit-identical to the plain model. `attend_newest` is the
faster path for one sequence whose queries are its newest keys (the engine's packed forwards: plain steps,
drafts and verifies); over a long float32 cache on the CPU it takes the kernels of
`kvlab.attention_kernels`. `*_reference` functions are what fast paths are tested against.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvlab import attention_kernels as kernels


@dataclasses.dataclass(frozen=True, eq=False)
class Visibility:
    """Which stored keys each query may attend: where the queries and keys sit in their sequences.

    Attributes:
        query_positions: [B, q] int64, the true sequence position of each query.
        key_lengths: Valid stored keys per row (len B, each <= T); the newest keys are the queries' own.
        key_positions: [B, T] int64 true positions of the stored keys, or None when position == index.
        sliding_window: Keys at least this many positions behind a query are invisible; None when no
            query is that far along (the caller knows the positions without a device sync).
    """

    query_positions: torch.Tensor
    key_lengths: list[int]
    key_positions: torch.Tensor | None = None
    sliding_window: int | None = None

    def mask(self, num_keys: int) -> torch.Tensor:
        """Boolean [B, 1, q, T] over `num_keys` stored keys (see `visibility_mask`)."""
        return visibility_mask(
            self.query_positions, self.key_lengths, num_keys, self.key_positions, self.sliding_window
        )


def attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visibility: Visibility,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of `q` new queries per row over stored keys.

    Args:
        queries: [B, H, q, D], rotary already applied.
        keys: [B, H_kv, T, D], stored keys (rows may be valid only up to `visibility.key_lengths[b]`).
        values: [B, H_kv, T, D].
        visibility: Positions of the queries and keys, and the sliding window.
        scaling: Softmax scale.
        softcap: Attention-logit soft-cap (Gemma 2), or None; soft-capped attention takes the explicit path.

    Returns:
        [B, H, q, D] attention output in the queries' dtype.
    """
    num_queries, num_keys = queries.shape[2], keys.shape[2]
    gqa = queries.shape[1] != keys.shape[1]
    uniform = visibility.key_positions is None and all(length == num_keys for length in visibility.key_lengths)
    if softcap is not None:
        everything_visible = uniform and visibility.sliding_window is None and num_queries == 1
        mask = None if everything_visible else visibility.mask(num_keys)
        return softcapped_attention(queries, keys, values, mask, scaling, softcap)
    if uniform and visibility.sliding_window is None:
        if num_queries == 1:
            return F.scaled_dot_product_attention(queries, keys, values, scale=scaling, enable_gqa=gqa)
        if num_queries == num_keys:
            return F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scaling, enable_gqa=gqa)
        if 2 * num_queries > num_keys and _queries_are_newest_keys(visibility.query_positions, num_keys):
            return _padded_causal(queries, keys, values, scaling, gqa)
    mask = visibility.mask(num_keys)
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def softcapped_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float,
) -> torch.Tensor:
    """Attention whose scores are soft-capped, `softcap * tanh(q k^T * scaling / softcap)` (Gemma 2).

    No SDPA kernel soft-caps, so this is written out in the order of transformers' eager attention
    (scale, cap, mask, float32 softmax cast back, weights times values): on the same inputs the
    outputs are bit-identical to the model's own forward.

    Args:
        queries: [B, H, q, D]; keys, values: [B, H_kv, T, D] (H a multiple of H_kv).
        mask: Boolean [B, 1, q, T], True where visible, or None when every key is visible.

    Returns:
        [B, H, q, D] in the queries' dtype.
    """
    group = queries.shape[1] // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(queries, keys.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(weights, values)


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


def attend_newest(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of one row's newest queries: the q queries are the last q of the T stored keys.

    The fast path for decoding and verifying one sequence. The query heads of each GQA group are
    folded into query rows of their KV head ([1, H_kv, G*q, D], no copy of the keys). On the CPU over a
    float32 cache, up to `NEWEST_ATTENTION_MAX_ROWS` rows (a decode step, a draft, a short verify) take the
    C++ split-KV kernel. Otherwise one query sees every key: one unmasked call (over a long cache the
    compiled `split_kv_decode`). A few
    queries (a verify, float32) take `folded_scores`: their scores over all T keys in one matrix product
    per KV head, the causal block masked in place; on the CPU over a long cache, `verify_in_pieces`,
    which spreads the keys evenly over the threads (both in `kvlab.attention_kernels`). Longer runs
    split: the first T - q keys, which every query sees, unmasked through the flash kernel, the q x q
    causal block apart, the two merged exactly by their log-sum-exp. Equal in argmax and close in value
    to `attend_newest_reference` (the reduction order differs, so the last bits may too).

    Args:
        queries: [1, H, q, D], rotary applied.
        keys: [1, H_kv, T, D] stored keys (T >= q), the queries' own keys last.
        values: [1, H_kv, T, D].
        scaling: Softmax scale.

    Returns:
        [1, H, q, D] in the queries' dtype.
    """
    _, heads, num_queries, dim = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    num_prefix = num_keys - num_queries
    folded = queries.reshape(1, kv_heads, group * num_queries, dim)
    cpu_float32 = keys.device.type == "cpu" and keys.dtype == torch.float32
    if kernels.takes_newest_kernel(folded, keys):
        outputs = kernels.NEWEST_ATTENTION.attend([folded[0]], [keys], [values], [num_queries], scaling)
        assert outputs is not None
        return outputs[0].reshape(1, heads, num_queries, dim)
    if num_queries == 1:
        if num_keys >= kernels.SPLIT_KV_MIN_KEYS and cpu_float32:
            output = kernels.SPLIT_KV.attend(folded, keys, values, scaling)
            if output is not None:
                return output.reshape(1, heads, 1, dim)
        # Every key is visible: one unmasked call, which needs no log-sum-exp.
        return F.scaled_dot_product_attention(folded, keys, values, scale=scaling).reshape(1, heads, 1, dim)
    if num_queries <= FOLDED_SCORES_MAX_QUERIES and keys.dtype == torch.float32:
        pieces = kernels.key_pieces(kv_heads)
        long_enough = num_prefix >= kernels.PIECES_MIN_KEYS and num_queries >= kernels.PIECES_MIN_QUERIES
        if cpu_float32 and pieces > 1 and long_enough:
            output = kernels.verify_in_pieces(folded, keys, values, scaling, num_queries, pieces)
        else:
            output, _ = kernels.folded_scores(folded, keys, values, scaling, num_queries)
        return output.reshape(1, heads, num_queries, dim)
    block_keys, block_values = keys[:, :, num_prefix:], values[:, :, num_prefix:]
    if group > 1:
        block_keys = block_keys.repeat_interleave(group, dim=1)
        block_values = block_values.repeat_interleave(group, dim=1)
    block, block_lse = attention_with_lse(queries, block_keys, block_values, scaling, causal=True)
    if num_prefix == 0:
        return block
    prefix, prefix_lse = attention_with_lse(
        folded, keys[:, :, :num_prefix], values[:, :, :num_prefix], scaling, causal=False
    )
    prefix = prefix.reshape(1, heads, num_queries, dim)
    prefix_lse = prefix_lse.reshape(1, heads, num_queries)
    return merge_attention(prefix, prefix_lse, block, block_lse).to(queries.dtype)


def attend_newest_each(
    queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor], scaling: float
) -> list[torch.Tensor]:
    """`attend_newest` for several sequences (a packed forward's segments): those the C++ split-KV kernel takes
    (`kvlab.attention_kernels.takes_newest_kernel`: decode steps, drafts, short verifies) in one call, whose
    work items (sequence x KV head x chunk of keys) spread over the threads, the others one by one. Each
    sequence's output is the one `attend_newest` gives it alone, bit for bit (its chunks and their merge do
    not depend on the others).

    Args:
        queries: Per sequence [1, H, q, D], rotary applied (any float dtype: attention runs in the keys').
        keys, values: Per sequence [1, H_kv, T, D], the queries' own keys last.
        scaling: Softmax scale.

    Returns:
        Per sequence [1, H, q, D] in its queries' dtype.
    """
    outputs: list[torch.Tensor | None] = [None] * len(queries)
    together: list[tuple[int, torch.Tensor]] = []
    for index, (query, key, value) in enumerate(zip(queries, keys, values, strict=True)):
        folded = query.to(key.dtype).reshape(key.shape[1], -1, query.shape[-1])  # [H_kv, G*q, D]
        if len(queries) > 1 and kernels.takes_newest_kernel(folded, key):
            together.append((index, folded))
        else:
            outputs[index] = attend_newest(query.to(key.dtype), key, value, scaling).to(query.dtype)
    if together:
        indices = [index for index, _ in together]
        results = kernels.NEWEST_ATTENTION.attend(
            [folded for _, folded in together], [keys[i] for i in indices], [values[i] for i in indices],
            [queries[i].shape[2] for i in indices], scaling)
        assert results is not None
        for index, result in zip(indices, results, strict=True):
            outputs[index] = result.reshape(queries[index].shape).to(queries[index].dtype)
    return [output for output in outputs if output is not None]


# Up to this many queries per row `attend_newest` materializes the scores (H * q * T floats; in pieces, the
# q x q causal block's). Measured at 8064 keys, 9 + 1 heads of 64, 2 threads: 9 queries take 3.0-3.4 ms
# against 3.8-4.6 ms split.
FOLDED_SCORES_MAX_QUERIES = 64


def attend_newest_reference(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """`attend_newest` as one masked SDPA call with GQA expansion: the plain reference it is tested against."""
    num_queries, num_keys = queries.shape[2], keys.shape[2]
    positions = torch.arange(num_keys - num_queries, num_keys, device=queries.device)[None]
    mask = visibility_mask(positions, [num_keys], num_keys)
    gqa = queries.shape[1] != keys.shape[1]
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def attention_with_lse(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [B, H, q, D] and the log-sum-exp [B, H, q] (float32) of its scores.

    Same number of query and key heads. `causal` with q == T masks the upper triangle. On CPU this is
    the flash kernel that returns its log-sum-exp; elsewhere the plain formula.
    """
    if queries.device.type == "cpu":
        output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, keys, values, 0.0, causal, scale=scaling
        )
        return output, lse
    return attention_with_lse_reference(queries, keys, values, scaling, causal)


def attention_with_lse_reference(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` written out: softmax(q k^T * scale) v, in float32."""
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scaling
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    output = torch.matmul(torch.exp(scores - lse[..., None]), values.float())
    return output.to(queries.dtype), lse


def merge_attention(
    first: torch.Tensor, first_lse: torch.Tensor, second: torch.Tensor, second_lse: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's output and log-sum-exp.

    Args:
        first, second: [B, H, q, D] outputs over each key set.
        first_lse, second_lse: [B, H, q] log-sum-exp of each set's scaled scores.

    Returns:
        [B, H, q, D] float32: softmax over all keys, each output weighted by its share of the mass.
    """
    top = torch.maximum(first_lse, second_lse)
    first_weight = torch.exp(first_lse - top)[..., None]
    second_weight = torch.exp(second_lse - top)[..., None]
    return (first.float() * first_weight + second.float() * second_weight) / (first_weight + second_weight)
