"""Which source drafts a row: prompt lookup (free) or the compressed cache (draft forwards).

`ngram+<compressor>` drafters propose the continuation of the longest recent n-gram match in the
row's history when that is expected to emit more tokens per second than drafting from the compressed
cache, from what each source's rounds emitted for this sequence and the measured costs: a lookup
round costs one vLLM step, a cache round one vLLM step plus `k` draft forwards.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Source = Literal["lookup", "cache"]
# Weight of history in the running averages.
_DECAY = 0.7


def running_mean(old: float | None, sample: float) -> float:
    return sample if old is None else _DECAY * old + (1 - _DECAY) * sample


@dataclasses.dataclass(slots=True)
class SourceRecord:
    """A sequence's tokens per round from each source, and the source of its pending round.

    Attributes:
        lookup, cache: Average tokens a round of that source emitted (accepted drafts + 1); None until
            measured.
        pending: The source whose drafts vLLM verifies next (None: the last step drafted nothing).
    """

    lookup: float | None = None
    cache: float | None = None
    pending: Source | None = None

    def record(self, num_emitted: int) -> None:
        """The pending round emitted `num_emitted` tokens (vLLM's sampled tokens of the row)."""
        if self.pending == "lookup":
            self.lookup = running_mean(self.lookup, num_emitted)
        elif self.pending == "cache":
            self.cache = running_mean(self.cache, num_emitted)
        self.pending = None

    def takes_lookup(self, costs: DraftCosts, num_draft_tokens: int) -> bool:
        """Whether a round whose lookup found a proposal should use it rather than the compressed cache
        (the lookup is tried while unmeasured; an unmeasured cache is assumed to accept every draft)."""
        if self.lookup is None or costs.step_s is None or costs.draft_forward_s is None:
            return True
        cache = self.cache if self.cache is not None else num_draft_tokens + 1.0
        cache_round_s = costs.step_s + num_draft_tokens * costs.draft_forward_s
        return self.lookup / costs.step_s >= cache / cache_round_s


@dataclasses.dataclass(slots=True)
class DraftCosts:
    """Measured costs: vLLM's step (from one propose call's end to the next one's start) and one packed
    draft forward, seconds (running averages; None until measured)."""

    step_s: float | None = None
    draft_forward_s: float | None = None
