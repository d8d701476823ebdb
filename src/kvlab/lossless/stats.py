"""Statistics of lossless speculative decoding (returned as data, never printed)."""

from __future__ import annotations

import dataclasses

from kvlab.generation.outputs import GenerationOutput


@dataclasses.dataclass(slots=True)
class LosslessStats:
    """Counts and timings of the draft/verify rounds of one `generate_lossless` call.

    Attributes:
        rounds: Verify passes, one per sequence per round.
        num_plain_rounds: Rounds that drafted nothing, a plain step on the full cache: the sequence
            stood aside (under `auto`, the planner expected a plain step to pay more) or had one token left.
        num_lookup_rounds, num_lookup_accepted_tokens: Rounds whose drafts came from prompt lookup
            (`ngram+` drafters), and how many of those drafts were accepted.
        num_draft_tokens: Tokens drafted, all sequences together.
        num_accepted_tokens: Drafted tokens the full model accepted.
        acceptance_length: Mean tokens emitted per round, the accepted drafts plus the correction or
            bonus token (vLLM's definition; 1.0 means no draft was ever accepted).
        drafted_per_position: drafted_per_position[i] = rounds that drafted a token at position i.
        accepted_per_position: accepted_per_position[i] = rounds whose draft at position i was accepted.
        draft_s: Seconds of forwards that only drafted.
        verify_s: Seconds of forwards that verified (draft segments packed into them included).
        kv_load_s: Seconds verify forwards waited for the full KV to arrive from its tier.
        num_draft_tokens_per_round: Draft length of every round, in order.
        num_plans: Rounds the planner planned per source ("plain", "compressed_cache", "prompt_lookup"),
            the engine's figures only.
        cost_model_ticks: Ticks the cost model predicted before seeing them (the engine's figures only).
        cost_model_mre: Mean relative error of those predictions, |predicted - measured| / measured, per
            tick, the tiers' waits excluded (None before any tick was compared).
        cost_model_coefficients: The fit per set of weights: seconds of a forward's fixed part, per token,
            per thousand keys read by one-query segments, per thousand keys read by several-query segments,
            and per hundred thousand query-key pairs past each segment's first query (in segments of up to 64
            queries, and in longer ones) (`kvlab.lossless.cost_model`).
    """

    rounds: int = 0
    num_plain_rounds: int = 0
    num_lookup_rounds: int = 0
    num_lookup_accepted_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_length: float = 0.0
    drafted_per_position: list[int] = dataclasses.field(default_factory=list)
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    kv_load_s: float = 0.0
    num_draft_tokens_per_round: list[int] = dataclasses.field(default_factory=list)
    num_plans: dict[str, int] = dataclasses.field(default_factory=dict)
    cost_model_ticks: int = 0
    cost_model_mre: float | None = None
    cost_model_coefficients: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def record_round(self, num_draft_tokens: int, num_accepted_tokens: int, looked_up: bool = False) -> None:
        """Add one round of one sequence (`looked_up`: its drafts came from prompt lookup)."""
        self.num_lookup_rounds += looked_up
        self.num_lookup_accepted_tokens += num_accepted_tokens if looked_up else 0
        self.num_draft_tokens_per_round.append(num_draft_tokens)
        while len(self.drafted_per_position) < num_draft_tokens:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        self.rounds += 1
        self.num_plain_rounds += num_draft_tokens == 0
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_draft_tokens):
            self.drafted_per_position[position] += 1
            self.accepted_per_position[position] += position < num_accepted_tokens
        self.acceptance_length = (self.num_accepted_tokens + self.rounds) / self.rounds

    @property
    def num_drafting_rounds(self) -> int:
        """Rounds that drafted at least one token."""
        return self.rounds - self.num_plain_rounds

    @property
    def mean_num_draft_tokens(self) -> float:
        rounds = self.num_draft_tokens_per_round
        return sum(rounds) / len(rounds) if rounds else 0.0


@dataclasses.dataclass(slots=True)
class LosslessOutput(GenerationOutput):
    """`GenerationOutput` plus the draft/verify statistics."""

    lossless: LosslessStats = dataclasses.field(default_factory=LosslessStats)
