"""Query-agnostic SnapKV: SnapKV's scoring, observed from positions spread over the context."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvlab.compress.base import CompressionContext, compressors
from kvlab.compress.eviction import ALWAYS_KEEP, require_queries
from kvlab.compress.snapkv import SnapKVCompressor


@compressors.register("snapkv_agnostic")
@dataclasses.dataclass
class SnapKVAgnosticCompressor(SnapKVCompressor):
    """SnapKV (Li et al., 2024) with a generic observation window, so the selection ignores the question.

    Family: eviction. SnapKV scores the context by the attention of the prompt's last `window_size`
    queries, which in a question-answering prompt are the question: the cache it keeps serves that
    question and may drop what a later question needs (SCBench, Li et al., 2025). This variant scores
    with `window_size` queries at positions spread evenly over the context before the last
    `window_size` tokens (each attending causally to the tokens before it), pooled as SnapKV pools;
    the last `window_size` tokens are kept, as in SnapKV, but their queries are not used.

    Budget: `budget` (or the prompt minus `compression_ratio`) counts the kept last window too.

    Hyper-parameters and their checks are SnapKV's; only the scoring differs.

    A prompt whose queries are observed only for its last tokens (prefilled in pieces, or completed
    after KV restored from a store) spreads the positions over the observed tokens, or scores as SnapKV
    when none of them precedes the kept window.

    Deviations from SnapKV:
    - the observation window is spread over the context, not the prompt's end (the point of the
      variant; SCBench's query-agnostic setting, without KVzip's extra reconstruction forward);
    - GQA as in kvlab's SnapKV: attention averaged over the query heads of each KV head.
    """

    observes_every_query: ClassVar[bool] = True

    window_size: int = dataclasses.field(default=32, metadata={"help": "observing positions, and last tokens kept"})

    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        queries = require_queries(context, "snapkv_agnostic")
        num_context = keys.shape[1] - min(self.window_size, keys.shape[1])
        scores = torch.full((keys.shape[0], keys.shape[1]), ALWAYS_KEEP, device=keys.device)
        if num_context == 0:
            return scores
        # The queries cover the prompt's last tokens only when its first tokens' KV came from elsewhere or
        # it was prefilled in pieces: observe from the positions they cover, or, when none of them lies
        # before the kept window, score as SnapKV does from the last queries.
        first_observed = keys.shape[1] - queries.shape[1]
        if first_observed >= num_context:
            return SnapKVCompressor.score(self, keys, values, context)
        positions = first_observed + observation_positions(num_context - first_observed, self.window_size,
                                                           keys.device)
        attention = attention_from_positions(queries[:, positions - first_observed], keys[:, :num_context],
                                             positions, context.scaling)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d
        padding = self.kernel_size // 2
        scores[:, :num_context] = pool(attention[:, None], self.kernel_size, stride=1, padding=padding)[:, 0]
        return scores


def observation_positions(num_context: int, count: int, device: torch.device | str) -> torch.Tensor:
    """[<= count] int64 distinct positions spread evenly over 0..num_context-1, last one included.

    Computed on the host from the two sizes and copied over: `unique` on an accelerator would read its
    result's length back (a device round trip), and there are only `count` of them.
    """
    steps = min(count, num_context)
    return torch.linspace(0, num_context - 1, steps).round().long().unique().to(device)


def attention_from_positions(
    queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scaling: float
) -> torch.Tensor:
    """[H_kv, T] attention each key receives from the queries at `positions` (causal), summed over them.

    Args:
        queries: [H, W, D] queries at `positions`, rotary applied.
        keys: [H_kv, T, D] keys of positions 0..T-1.
        positions: [W] int64 positions of the queries, each < T.
        scaling: Softmax scale.
    """
    num_heads, window, _ = queries.shape
    num_kv_heads, num_tokens, _ = keys.shape
    grouped = queries.float().view(num_kv_heads, num_heads // num_kv_heads, window, -1)
    logits = torch.einsum("hgwd,htd->hgwt", grouped, keys.float()) * scaling
    future = torch.arange(num_tokens, device=keys.device)[None, :] > positions[:, None]
    logits.masked_fill_(future, float("-inf"))
    return logits.softmax(dim=-1).mean(dim=1).sum(dim=1)
