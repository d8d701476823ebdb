"""A source's acceptance per draft position, and its best round length from that and what each length costs.

`Acceptance` and `choose_length` (a pure function) are shared by the engine's round planner
(`kvlab.lossless.planner`) and the vLLM proposer's per-row plan (`kvlab.integrations.vllm.sources`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable


@dataclasses.dataclass(slots=True)
class Acceptance:
    """One source's acceptance per draft position, for one sequence.

    Attributes:
        prior: Acceptance of a draft given the ones before it were, before any evidence.
        prior_weight: How many drafts' worth of evidence the prior counts for.
        reached: reached[i]: rounds whose draft i was drafted with drafts 0..i-1 all accepted (aged).
        accepted: accepted[i]: of those, rounds whose draft i was accepted (aged).
        aging: Evidence kept per round this source is not used (uncertainty grows while it is aside).
        shrinkage: How many drafts' worth a position's estimate leans on the pooled one.
        growth: Positions credited reach at most this many times the evidence frontier (`credited`).
        min_credited: Positions credited before any evidence.
    """

    prior: float
    prior_weight: float = 2.0
    reached: list[float] = dataclasses.field(default_factory=list)
    accepted: list[float] = dataclasses.field(default_factory=list)
    aging: float = 0.95
    shrinkage: float = 2.0
    growth: float = 2.0
    min_credited: int = 4

    def pooled(self) -> tuple[float, float]:
        """(mean, evidence): acceptance over every position, with the prior counted in."""
        evidence = sum(self.reached) + self.prior_weight
        return (sum(self.accepted) + self.prior * self.prior_weight) / evidence, evidence

    def credited(self) -> int:
        """Draft positions a round is credited with at most: `growth` times the frontier (the positions that
        rounds reached about once or more, aged), `min_credited` at least.

        Past the frontier an estimate is the pooled one with the spread of a position never seen, so with any
        optimism every position there reads as near-certain: after five drafts accepted out of five, a
        sequence at 8K and batch 8 probed a round of 64 drafts for 63 tokens and emitted 4 (in another traced
        run, five rounds of 47 to 51 drafts expected 247 tokens and emitted 50). Acceptance runs in stretches (a copied
        passage ends), which per-position rates cannot see; the lengths grow by doubling instead, as evidence
        comes in."""
        frontier = sum(count >= 0.5 for count in self.reached)  # reached[i] never rises with i
        return max(int(self.growth * frontier), self.min_credited)

    def expected_tokens(self, max_tokens: int, optimism: float) -> list[float]:
        """[max_tokens + 1] tokens a round of k drafts emits on average, for k = 0..max_tokens (the
        verify's own token included), with each a_i raised by `optimism` standard deviations; positions
        past `credited()` add nothing."""
        mean, evidence = self.pooled()
        expected, survive = [1.0], 1.0
        credited = self.credited()
        for position in range(max_tokens):
            if position >= credited:
                expected.append(expected[-1])
                continue
            reached = self.reached[position] if position < len(self.reached) else 0.0
            accepted = self.accepted[position] if position < len(self.accepted) else 0.0
            weight = reached + self.shrinkage
            estimate = (accepted + self.shrinkage * mean) / weight
            spread = math.sqrt(estimate * (1.0 - estimate) / (weight + 1.0))
            survive *= min(estimate + optimism * spread, 0.999)
            expected.append(expected[-1] + survive)
        return expected

    def update(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Fold in one round that drafted `num_draft_tokens` of this source."""
        reached = min(num_accepted_tokens + 1, num_draft_tokens)
        while len(self.reached) < reached:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for position in range(reached):
            self.reached[position] += 1.0
            self.accepted[position] += position < num_accepted_tokens
        for position in range(reached, len(self.reached)):
            # Positions this round did not reach age, so one early rejection there does not hold the
            # round lengths down for good: they return towards the pooled estimate.
            self.reached[position] *= self.aging
            self.accepted[position] *= self.aging

    def age(self) -> None:
        """A round that did not use this source: its evidence counts a little less."""
        self.reached = [count * self.aging for count in self.reached]
        self.accepted = [count * self.aging for count in self.accepted]


# Lengths tried past the last one that raised the best rate (the search's end; planning runs every round).
LENGTHS_PAST_THE_PEAK = 8


@dataclasses.dataclass(frozen=True, slots=True)
class LengthChoice:
    """A drafter's best length: its expected tokens and seconds (a probe's tokens are the optimistic ones)."""

    num_draft_tokens: int
    expected_tokens: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.expected_tokens / max(self.seconds, 1e-9)


def choose_length(acceptance: Acceptance, lengths: Iterable[int], round_s: Callable[[int], float], plain_s: float,
                  optimism: float) -> LengthChoice:
    """The length with the most expected tokens per second (each acceptance raised by half of `optimism`
    standard deviations), credited with its mean; where only the optimistic estimate (`optimism` standard
    deviations) beats a plain step of `plain_s`, that length as a probe, credited with its optimistic rate.

    Args:
        acceptance: The source's acceptance per draft position.
        lengths: The lengths allowed (at least one, each >= 1).
        round_s: Seconds a round of that many drafts costs (drafting, verify, link).
        plain_s: Seconds a plain step costs instead.
        optimism: Standard deviations added to each acceptance for the probe test (0: none).
    """
    lengths = list(lengths)
    means = acceptance.expected_tokens(max(lengths), 0.0)
    leaning = acceptance.expected_tokens(max(lengths), optimism / 2)
    hopes = acceptance.expected_tokens(max(lengths), optimism)
    best: LengthChoice | None = None
    best_leaning, last_gain = 0.0, 0
    for length in lengths:
        if best is not None and length - last_gain > LENGTHS_PAST_THE_PEAK:
            break  # tokens per second past the peak only fall: E(k) flattens while the round's cost grows
        seconds = max(round_s(length), 1e-9)
        # The length leans a little optimistic (half the optimism), so positions rarely reached get tried.
        if best is None or leaning[length] / seconds > best_leaning:
            best, best_leaning = LengthChoice(length, means[length], seconds), leaning[length] / seconds
            last_gain = length
    assert best is not None, "choose_length needs at least one length"
    # A probe is credited with its own optimistic tokens: crediting it with a longer length's hope would
    # probe at a length that loses even if every hope came true (measured at 8K, batch 8: rounds of 2
    # drafts taken for 3.39 tokens, more than 2 drafts can emit).
    hope = hopes[best.num_draft_tokens]
    if best.rate * plain_s < 1.0 <= hope / best.seconds * plain_s:
        best = LengthChoice(best.num_draft_tokens, hope, best.seconds)
    return best
