"""Which drafted tokens the full-KV model accepts (pure tensor functions).

Both rules return, per row, the number of accepted draft tokens n and the token that follows them:
the target's correction at the first rejected position, or the bonus token after k acceptances.
"""

from __future__ import annotations

import torch

from kvlab.generation.config import GenerationConfig
from kvlab.generation.sampling import token_probabilities


def greedy_accept(draft_token_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafted tokens while they equal the target's argmax.

    Args:
        draft_token_ids: [B, k] int64 drafted tokens.
        target_logits: [B, k + 1, V] logits of the verify pass; position i predicts draft token i + 1
            (position k predicts the bonus token).

    Returns:
        (num_accepted_tokens [B] int64 in 0..k, next_token_ids [B] int64): the output continues with
        the accepted drafts and then the target's own choice at position num_accepted_tokens.
    """
    target_token_ids = target_logits.argmax(dim=-1)
    matches = (draft_token_ids == target_token_ids[:, :-1]).long()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)
    next_token_ids = target_token_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token_ids


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling: the output follows the target distribution exactly.

    Draft token x_i (drawn from q_i) is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the
    first rejection the next token is drawn from the residual max(0, p_i - q_i), renormalized; if all
    k are accepted, a bonus token is drawn from p_k.

    Args:
        draft_token_ids: [B, k] int64.
        draft_probs: [B, k, V] float distributions the drafts were sampled from.
        target_probs: [B, k + 1, V] float target distributions (same warping as the draft's).
        generator: Source of randomness.

    Returns:
        (num_accepted_tokens [B] int64, next_token_ids [B] int64).
    """
    batch, num_draft = draft_token_ids.shape
    index = draft_token_ids[:, :, None]
    p = target_probs[:, :num_draft].gather(2, index).squeeze(2)
    q = draft_probs.gather(2, index).squeeze(2)
    uniform = torch.rand(batch, num_draft, generator=generator, device=draft_token_ids.device)
    # u < p / q written without division, so q == 0 (impossible draws) never yields NaN.
    accepted = (uniform * q < p).long()
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch, device=draft_token_ids.device)
    stop = num_accepted.clamp(max=num_draft - 1) if num_draft else num_accepted
    residual = (target_probs[rows, stop] - draft_probs[rows, stop]).clamp_min(0) if num_draft else None
    bonus = target_probs[rows, num_accepted]
    all_accepted = (num_accepted == num_draft)[:, None]
    if residual is None:
        final = bonus
    else:
        # A residual can be all zeros only when p == q, where a rejection has probability 0.
        residual_mass = residual.sum(dim=-1, keepdim=True)
        safe_residual = torch.where(residual_mass > 0, residual, target_probs[rows, stop])
        final = torch.where(all_accepted, bonus, safe_residual)
    next_token_ids = torch.multinomial(final / final.sum(dim=-1, keepdim=True), 1, generator=generator).squeeze(1)
    return num_accepted, next_token_ids


def accept_drafts(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    config: GenerationConfig,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule `config` calls for: `greedy_accept`, or `rejection_sample` on the target's warped
    distribution (`draft_probs` [B, k, V] must then be given)."""
    if config.greedy:
        return greedy_accept(draft_token_ids, target_logits)
    assert draft_probs is not None, "sampling needs the draft distributions"
    target_probs = token_probabilities(target_logits, config.temperature, config.top_p)
    return rejection_sample(draft_token_ids, draft_probs, target_probs, generator)
