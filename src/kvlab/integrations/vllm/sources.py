"""Which source drafts each row of a vLLM step, and how many tokens: kvlab's planner, adapted to vLLM.

Each row keeps kvlab's `Acceptance` per drafter (prompt lookup, the compressed cache), updated from the
tokens vLLM accepted of its last proposal. A step's choice is made for all rows together with the shared
`choose_length` (`kvlab.lossless.planner`): vLLM's step verifies every row in one forward whatever it
proposes, so a row's plain step costs its share of that step, and a lookup round no more; a round from
the compressed cache adds its share of the packed draft forwards, whose cost the rows drafting together
split (kvlab's fitted cost model of those forwards). A row whose best round does not beat its plain step
proposes nothing.
"""

from __future__ import annotations

import dataclasses

from kvlab.lossless.compressed_cache import CompressedCacheDrafter
from kvlab.lossless.cost_model import ForwardCostModel, SegmentShape
from kvlab.lossless.lengths import choose_length
from kvlab.lossless.planner import Acceptance
from kvlab.lossless.prompt_lookup import PromptLookup

LOOKUP, CACHE = "prompt_lookup", "compressed_cache"
# Weight of history in vLLM's step time.
_DECAY = 0.7
# Prior acceptance of each source's drafts (a draft's, given the ones before it were accepted).
PRIORS = {LOOKUP: PromptLookup.prior_acceptance, CACHE: CompressedCacheDrafter.prior_acceptance}


def running_mean(old: float | None, sample: float) -> float:
    return sample if old is None else _DECAY * old + (1 - _DECAY) * sample


@dataclasses.dataclass(slots=True)
class RowRecord:
    """A sequence's acceptance per source, and the round vLLM verifies next.

    Attributes:
        acceptance: Per source name.
        pending: (source, tokens proposed) of the round vLLM verifies next (None: it proposed nothing).
    """

    acceptance: dict[str, Acceptance] = dataclasses.field(
        default_factory=lambda: {name: Acceptance(prior) for name, prior in PRIORS.items()})
    pending: tuple[str, int] | None = None

    def record(self, num_emitted: int) -> None:
        """The pending round emitted `num_emitted` tokens (vLLM's sampled tokens of the row: accepted + 1)."""
        if self.pending is not None:
            source, num_drafted = self.pending
            self.acceptance[source].update(num_drafted, min(num_emitted - 1, num_drafted))
        self.pending = None


@dataclasses.dataclass(slots=True)
class StepCosts:
    """What a vLLM step and the proposer's draft forwards cost.

    Attributes:
        weights: The draft weights the proposer's forwards run.
        draft: kvlab's cost model, fitted to the proposer's packed draft forwards.
        step_s: vLLM's step, from one propose call's end to the next one's start (None until measured).
    """

    weights: str
    draft: ForwardCostModel = dataclasses.field(default_factory=ForwardCostModel)
    step_s: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RowPlan:
    """A row's proposal for this step: its source (None: nothing) and how many tokens."""

    source: str | None
    num_draft_tokens: int


def plan_rows(records: list[RowRecord], lookups: list[list[int]], cached: list[int], max_tokens: int,
              costs: StepCosts, optimism: float = 1.0) -> list[RowPlan]:
    """Each row's source and length for one vLLM step.

    Args:
        records: Per row, its acceptance and pending round.
        lookups: Per row, its prompt lookup's proposal ([] where none or no lookup).
        cached: Per row, the tokens its draft cache holds (what a draft forward attends over).
        max_tokens: vLLM's `num_speculative_tokens`.
        costs: vLLM's measured step and the fitted model of the proposer's draft forwards.
        optimism: Standard deviations of exploration (`choose_length`).
    """
    if costs.step_s is None or not costs.draft.ready(costs.weights):
        # Nothing measured yet: the free lookup where it has a proposal, else the cache (which measures).
        return [RowPlan(LOOKUP, len(p)) if p else RowPlan(CACHE, max_tokens) for p in lookups]
    plain_s = costs.step_s / max(len(records), 1)
    num_cache_rows = max(sum(not lookup for lookup in lookups), 1)
    plans = []
    for record, lookup, num_cached in zip(records, lookups, cached, strict=True):
        best, best_rate = RowPlan(None, 0), 1.0 / plain_s
        if lookup:
            choice = choose_length(record.acceptance[LOOKUP], range(1, len(lookup) + 1), lambda _: plain_s, plain_s,
                                   optimism)
            best, best_rate = RowPlan(LOOKUP, choice.num_draft_tokens), choice.rate
        draft_s = costs.draft.share_s(costs.weights, SegmentShape(1, num_cached), num_cache_rows)
        choice = choose_length(record.acceptance[CACHE], range(1, max_tokens + 1),
                               lambda length, draft_s=draft_s: plain_s + length * draft_s,  # type: ignore[misc]
                               plain_s, optimism)
        if choice.rate > best_rate:
            best = RowPlan(CACHE, choice.num_draft_tokens)
        plans.append(best)
    for record, plan in zip(records, plans, strict=True):
        for source, acceptance in record.acceptance.items():
            if source != plan.source:
                acceptance.age()
    return plans
