"""How many tokens to draft next: fixed, or adapted to measured acceptance and step costs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class DraftLengthController:
    """Chooses the draft length of each round.

    With `fixed` set, always drafts that many. Otherwise it models acceptance as geometric: each draft
    token is accepted with probability alpha given the previous ones were, so a round drafting k
    tokens emits (1 - alpha^(k+1)) / (1 - alpha) tokens on average. It estimates alpha and the costs of
    one draft step and of one verify pass from recent rounds (exponential moving averages), and picks
    the k in [1, max_length] that maximizes expected tokens per second. Same-model drafters with a
    dominant-attention cache accept long runs, so k grows to tens of tokens; weak drafters stay short.

    Attributes:
        fixed: A fixed draft length, or None to adapt.
        initial_length: Draft length of the first round when adapting.
        max_length: Upper bound of adaptive lengths.
        decay: Weight of history in the moving averages (0..1).
    """

    fixed: int | None = None
    initial_length: int = 8
    max_length: int = 64
    decay: float = 0.7
    accepted: float = 0.0
    rejected: float = 0.0
    draft_step_s: float = 0.0
    verify_s: float = 0.0

    def next_length(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.accepted + self.rejected == 0 or self.verify_s == 0:
            return self.initial_length
        # Laplace smoothing keeps alpha below 1 so the expected gain stays finite.
        alpha = (self.accepted + 0.5) / (self.accepted + self.rejected + 1.0)
        best_length, best_rate = 1, 0.0
        for length in range(1, self.max_length + 1):
            expected_tokens = (1 - alpha ** (length + 1)) / (1 - alpha)
            rate = expected_tokens / (length * self.draft_step_s + self.verify_s)
            if rate > best_rate:
                best_length, best_rate = length, rate
        return best_length

    def update(self, num_draft: int, num_accepted: list[int], draft_s: float, verify_s: float) -> None:
        """Fold in one round: per-row accepted counts and the round's draft and verify seconds."""
        if num_draft == 0:
            return
        accepted = sum(num_accepted) / len(num_accepted)
        rejected = sum(n < num_draft for n in num_accepted) / len(num_accepted)
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + rejected
        step = draft_s / num_draft
        self.draft_step_s = step if self.draft_step_s == 0 else self.decay * self.draft_step_s + (1 - self.decay) * step
        self.verify_s = verify_s if self.verify_s == 0 else self.decay * self.verify_s + (1 - self.decay) * verify_s
