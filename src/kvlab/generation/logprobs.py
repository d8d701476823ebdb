"""Log-probabilities of chosen tokens and their most likely alternatives, as pure tensor functions.

A scored token's log-probability is `log_softmax` of the model's raw logits at the position before it
(float32, before temperature, nucleus filtering or `min_tokens`), which is what OpenAI-style servers
report and what perplexity and log-likelihood evaluations read.
"""

from __future__ import annotations

import dataclasses

import torch

# OpenAI's API returns at most 20 alternatives per token.
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(slots=True)
class TokenLogprobs:
    """Scores of a run of tokens, one entry per token.

    Attributes:
        token_ids: The scored tokens.
        logprobs: Each token's log-probability given everything before it.
        top: Each position's most likely tokens as (token id, log-probability), most likely first
            (empty lists when no alternatives were asked for).
    """

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: TokenLogprobs) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.top.extend(other.top)

    def tail(self, num_tokens: int) -> TokenLogprobs:
        """The scores of the last `num_tokens` tokens."""
        start = len(self.token_ids) - num_tokens
        return TokenLogprobs(self.token_ids[start:], self.logprobs[start:], self.top[start:])


def score_tokens(logits: torch.Tensor, token_ids: list[int], num_top: int) -> TokenLogprobs:
    """The log-probability of each token under the logits that predicted it, and the top alternatives.

    Args:
        logits: [T, V] raw logits; row t predicts `token_ids[t]`.
        token_ids: T token ids.
        num_top: Alternatives kept per position (0: none).

    Returns:
        The scores, as Python floats taken from one float32 `log_softmax`, so a token that is the most
        likely one has exactly its top alternative's value.
    """
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(token_ids)} tokens")
    if not token_ids:
        return TokenLogprobs()
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(-1, ids[:, None])[:, 0].tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    if num_top:
        values, indices = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
        top = [list(zip(row_ids, row_values, strict=True))
               for row_ids, row_values in zip(indices.tolist(), values.tolist(), strict=True)]
    return TokenLogprobs(list(token_ids), chosen, top)
