"""Eviction family: keep the highest-scoring tokens of each KV head within a token budget.

A subclass only writes `score()`; this base turns budgets into token counts, selects the top tokens
per KV head (kept in their original order, so rotary phases and causality are untouched), gathers
them, and provides the attention statistics several methods score with.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterator

import torch

from kvlab.compress.base import FP16_BYTES, MAX_TOKENS, CompressedKV, CompressionContext, Compressor, check_range
from kvlab.errors import ConfigError

INDEX_BYTES = 4
ALWAYS_KEEP = math.inf


@dataclasses.dataclass(slots=True)
class EvictedKV(CompressedKV):
    """The kept tokens of one layer.

    Attributes:
        keys: [H_kv, budget, D] kept keys, in sequence order per head.
        values: [H_kv, budget, D] kept values (merging methods may have changed them).
        kept_indices: [H_kv, budget] int64 sequence positions of the kept tokens.
    """

    keys: torch.Tensor
    values: torch.Tensor
    kept_indices: torch.Tensor

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def nbytes(self) -> int:
        # Keys and values in fp16 storage format, plus one int32 position per kept token and head.
        return 2 * self.keys.numel() * FP16_BYTES + self.kept_indices.numel() * INDEX_BYTES


@dataclasses.dataclass
class EvictionCompressor(Compressor):
    """Family base: token budget per KV head, top-k selection by `score()`.

    Give `compression_ratio` (fraction of prompt tokens removed; 0.5 when neither is given) or
    `budget` (tokens kept), not both.
    """

    compression_ratio: float | None = dataclasses.field(
        default=None, metadata={"help": "fraction of prompt tokens removed (0 keeps all); default 0.5"}
    )
    budget: int | None = dataclasses.field(default=None, metadata={"help": "prompt tokens kept per KV head"})

    def __post_init__(self) -> None:
        if self.compression_ratio is not None and self.budget is not None:
            raise ConfigError("give compression_ratio or budget, not both")
        if self.compression_ratio is None and self.budget is None:
            self.compression_ratio = 0.5
        if self.compression_ratio is not None and not 0 <= self.compression_ratio < 1:
            raise ConfigError(f"compression_ratio must be in [0, 1), got {self.compression_ratio}")
        if self.budget is not None:
            check_range("budget", self.budget, 1, MAX_TOKENS)

    def check_prompt(self, num_tokens: int) -> None:
        self.num_kept(num_tokens)

    def num_kept(self, num_tokens: int) -> int:
        """Tokens kept per KV head out of a prompt of `num_tokens`."""
        if self.budget is not None:
            if self.budget > num_tokens:
                raise ConfigError(
                    f"budget {self.budget} is larger than the prompt ({num_tokens} tokens); "
                    "use a smaller budget or compression_ratio"
                )
            return self.budget
        assert self.compression_ratio is not None
        return max(1, num_tokens - int(num_tokens * self.compression_ratio))

    @abc.abstractmethod
    def score(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> torch.Tensor:
        """[H_kv, T] importance of each token per KV head; higher is kept, `ALWAYS_KEEP` forces it."""

    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> EvictedKV:
        num_tokens = keys.shape[1]
        kept_indices = self.select(keys, values, context, self.num_kept(num_tokens))
        return EvictedKV(gather_tokens(keys, kept_indices), gather_tokens(values, kept_indices), kept_indices)

    def select(
        self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext, num_kept: int
    ) -> torch.Tensor:
        """[H_kv, num_kept] int64 kept positions per head, ascending."""
        num_heads, num_tokens = keys.shape[0], keys.shape[1]
        if num_kept >= num_tokens:
            return torch.arange(num_tokens, device=keys.device).expand(num_heads, num_tokens).clone()
        scores = self.score(keys, values, context)
        # A stable sort breaks ties (max pooling makes many) toward earlier tokens, deterministically.
        order = scores.sort(dim=-1, descending=True, stable=True).indices
        return order[:, :num_kept].sort(dim=-1).values


def gather_tokens(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """[H, T, D] -> [H, K, D] rows at `indices` [H, K] per head."""
    return tensor.gather(1, indices[:, :, None].expand(-1, -1, tensor.shape[2]))


def attention_probabilities(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, chunk_size: int = 512
) -> Iterator[tuple[int, torch.Tensor]]:
    """Causal softmax attention of the last W queries over all T keys, per KV head, in query chunks.

    Query heads sharing a KV head (GQA) are averaged, so scores stay per KV head.

    Args:
        queries: [H, W, D] queries of the last W positions (W <= T), rotary applied.
        keys: [H_kv, T, D].
        scaling: Softmax scale.
        chunk_size: Queries per chunk (bounds memory at W x T per head).

    Yields:
        (start, probabilities) with probabilities [H_kv, chunk, T] float32 for queries start..start+chunk.
    """
    num_heads, window, _ = queries.shape
    num_kv_heads, num_tokens, _ = keys.shape
    groups = num_heads // num_kv_heads
    grouped = queries.float().view(num_kv_heads, groups, window, -1)
    key_index = torch.arange(num_tokens, device=keys.device)
    for start in range(0, window, chunk_size):
        chunk = grouped[:, :, start : start + chunk_size]
        logits = torch.einsum("hgwd,htd->hgwt", chunk, keys.float()) * scaling
        query_index = num_tokens - window + start + torch.arange(chunk.shape[2], device=keys.device)
        logits.masked_fill_(key_index[None, :] > query_index[:, None], -math.inf)
        yield start, logits.softmax(dim=-1).mean(dim=1)


def window_attention_sum(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """[H_kv, T] attention each key receives, summed over the given (last W) queries."""
    total = torch.zeros(keys.shape[0], keys.shape[1], device=keys.device)
    for _, probabilities in attention_probabilities(queries, keys, scaling):
        total += probabilities.sum(dim=1)
    return total


def sinks_and_recent_scores(keys: torch.Tensor, num_sinks: int) -> torch.Tensor:
    """[H_kv, T] scores keeping the first `num_sinks` tokens, then the most recent ones (StreamingLLM)."""
    num_heads, num_tokens = keys.shape[0], keys.shape[1]
    scores = torch.arange(num_tokens, dtype=torch.float32, device=keys.device).expand(num_heads, -1).clone()
    scores[:, :num_sinks] = ALWAYS_KEEP
    return scores


def require_queries(context: CompressionContext, method: str) -> torch.Tensor:
    if context.queries is None:
        raise ValueError(f"{method} observes queries but the cache passed none")
    return context.queries
