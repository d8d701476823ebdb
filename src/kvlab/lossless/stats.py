"""Statistics of lossless speculative decoding (returned as data, never printed)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class SpecStats:
    """Counts and timings of the draft/verify rounds of one `generate_lossless` call.

    Attributes:
        rounds: Verify passes, counted per row (a batch of 3 rows doing one pass counts 3).
        draft_tokens: Tokens drafted, all rows together.
        accepted_tokens: Drafted tokens the full model accepted.
        acceptance_length: Mean tokens emitted per row per round, the accepted drafts plus the
            correction or bonus token (vLLM's definition; 1.0 means no draft was ever accepted).
        drafted_per_position: drafted_per_position[i] = rounds that drafted a token at position i.
        accepted_per_position: accepted_per_position[i] = rounds whose draft at position i was accepted.
        draft_s: Seconds spent drafting from the compressed cache.
        verify_s: Seconds spent in verify passes on the full cache.
        kv_load_s: Seconds spent waiting for the full KV to be loaded from its tier before verifying.
        draft_lengths: Draft length of every round, in order.
    """

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_length: float = 0.0
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    kv_load_s: float = 0.0
    draft_lengths: list[int] = dataclasses.field(default_factory=list)

    def record_round(self, num_draft: int, num_accepted: list[int]) -> None:
        """Add one round: `num_draft` tokens drafted for each row, `num_accepted[b]` accepted in row b."""
        self.draft_lengths.append(num_draft)
        while len(self.drafted_per_position) < num_draft:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for accepted in num_accepted:
            self.rounds += 1
            self.draft_tokens += num_draft
            self.accepted_tokens += accepted
            for position in range(num_draft):
                self.drafted_per_position[position] += 1
                self.accepted_per_position[position] += position < accepted
        self.acceptance_length = (self.accepted_tokens + self.rounds) / self.rounds
