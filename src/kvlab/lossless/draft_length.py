"""How many tokens to draft next: fixed, or adapted to measured acceptance and forward costs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class StepCosts:
    """Measured seconds a sequence adds to a forward: per drafted token, and per verify.

    Forwards pack several sequences, drafting and verifying, so costs are estimated per segment:
    a forward with only draft segments gives the cost of one draft segment; a forward with verify
    segments gives, after the draft segments' share, the cost of one verify (the full-KV read and any
    wait for the tier included). Exponential moving averages with weight `decay` on history.
    """

    decay: float = 0.7
    draft_s: float = 0.0
    verify_s: float = 0.0

    def observe(self, seconds: float, num_draft_segments: int, num_verify_segments: int) -> None:
        """Fold in one forward (or one tick of two forwards) of the given segments."""
        if num_verify_segments == 0:
            if num_draft_segments:
                self.draft_s = self._average(self.draft_s, seconds / num_draft_segments)
            return
        verify = max(seconds - num_draft_segments * self.draft_s, 0.0) / num_verify_segments
        self.verify_s = self._average(self.verify_s, verify)

    def _average(self, old: float, new: float) -> float:
        return new if old == 0 else self.decay * old + (1 - self.decay) * new


@dataclasses.dataclass(slots=True)
class DraftLengthController:
    """Chooses the draft length of each round of one sequence.

    With `fixed` set, always drafts that many. Otherwise it models acceptance as geometric: each draft
    token is accepted with probability alpha given the previous ones were, so a round drafting k
    tokens emits (1 - alpha^(k+1)) / (1 - alpha) tokens on average. It estimates alpha from this
    sequence's recent rounds and takes the costs from the run's shared `StepCosts`, and picks the k in
    [1, max_num_draft_tokens] that maximizes expected tokens per second. Same-model drafters with a
    dominant-attention cache accept long runs, so k grows to tens of tokens; weak drafters stay short.

    Attributes:
        costs: Measured per-segment costs, shared by the sequences of a run.
        fixed: A fixed draft length, or None to adapt.
        initial_num_draft_tokens: Draft length of the first round when adapting.
        max_num_draft_tokens: Upper bound of adaptive lengths.
        decay: Weight of history in the acceptance averages (0..1).
    """

    costs: StepCosts
    fixed: int | None = None
    initial_num_draft_tokens: int = 8
    max_num_draft_tokens: int = 64
    decay: float = 0.7
    accepted: float = 0.0
    rejected: float = 0.0

    def next_num_draft_tokens(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.accepted + self.rejected == 0 or self.costs.verify_s == 0 or self.costs.draft_s == 0:
            return self.initial_num_draft_tokens
        # Laplace smoothing keeps alpha below 1 so the expected gain stays finite.
        alpha = (self.accepted + 0.5) / (self.accepted + self.rejected + 1.0)
        best_length, best_rate = 1, 0.0
        for length in range(1, self.max_num_draft_tokens + 1):
            expected_tokens = (1 - alpha ** (length + 1)) / (1 - alpha)
            rate = expected_tokens / (length * self.costs.draft_s + self.costs.verify_s)
            if rate > best_rate:
                best_length, best_rate = length, rate
        return best_length

    def update(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Fold in one round of this sequence."""
        if num_draft_tokens == 0:
            return
        self.accepted = self.decay * self.accepted + num_accepted_tokens
        self.rejected = self.decay * self.rejected + (num_accepted_tokens < num_draft_tokens)
