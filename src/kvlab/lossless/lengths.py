"""A drafter's best round length from its acceptance and what each length costs (a pure function).

`choose_length` is shared by the engine's round planner (`kvlab.lossless.planner`) and the vLLM
proposer's per-row plan (`kvlab.integrations.vllm.sources`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Protocol


class Acceptance(Protocol):
    """What a length's choice reads of a source's acceptance (`kvlab.lossless.planner.Acceptance`)."""

    def expected_tokens(self, max_tokens: int, optimism: float) -> list[float]:
        """[max_tokens + 1] tokens a round of k drafts emits on average, each acceptance raised by `optimism`
        standard deviations."""
        ...

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
