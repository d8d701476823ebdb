"""Next-token selection as pure tensor functions (shared by plain and speculative decoding)."""

from __future__ import annotations

import torch

from kvlab.generation.config import GenerationConfig


def token_probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampling draws from, after temperature and nucleus filtering.

    Args:
        logits: [..., V] raw logits.
        temperature: > 0.
        top_p: Keep the smallest set of most likely tokens whose probability mass reaches top_p
            (always at least one token), renormalized.

    Returns:
        [..., V] float32 probabilities.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # A token stays if the tokens ranked above it have not yet reached top_p.
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    filtered = torch.where(keep, probs, torch.zeros_like(probs))
    return filtered / filtered.sum(dim=-1, keepdim=True)


def select_next_tokens(
    logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator | None
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: [B, V] logits of the last position of each row.
        config: Greedy when `config.temperature == 0`, otherwise temperature/top-p sampling.
        generator: Source of randomness for sampling (ignored when greedy).

    Returns:
        [B] int64 token ids.
    """
    return draw_tokens(logits, config, generator)[0]


def draw_tokens(
    logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`select_next_tokens`, also returning the [B, V] distribution sampled from (None when greedy),
    which a speculative drafter hands to rejection sampling."""
    if config.greedy:
        return logits.argmax(dim=-1), None
    probs = token_probabilities(logits, config.temperature, config.top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1), probs


def sampling_generator(config: GenerationConfig, device: torch.device | str) -> torch.Generator | None:
    """The seeded generator sampling draws from (None when greedy: nothing is drawn)."""
    return None if config.greedy else torch.Generator(device).manual_seed(config.seed)


def suppress_stop_tokens(
    logits: torch.Tensor, num_generated: int, config: GenerationConfig, stop_token_ids: tuple[int, ...]
) -> torch.Tensor:
    """`logits` with the tokens that would end the sequence made impossible before `config.min_tokens`.

    Args:
        logits: [T, V] logits; row t chooses generated token number `num_generated + t` (0-based).
        num_generated: Tokens the sequence generated before row 0's.
        config: Its `min_tokens`.
        stop_token_ids: End-of-sequence and stop tokens.

    Returns:
        `logits` itself when no row is affected, else a copy with those tokens at -inf in the rows
        that choose a token before `min_tokens`.
    """
    num_rows = min(max(config.min_tokens - num_generated, 0), logits.shape[0])
    if not num_rows or not stop_token_ids:
        return logits
    suppressed = logits.clone()
    # An id past the vocabulary is never chosen: nothing to suppress.
    ids = torch.tensor([t for t in stop_token_ids if t < logits.shape[-1]], dtype=torch.long, device=logits.device)
    suppressed[:num_rows, ids] = float("-inf")
    return suppressed
