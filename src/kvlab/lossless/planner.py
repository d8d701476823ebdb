"""The round planner: each lossless round, which drafter and how many tokens, or a plain step, for goodput.

A round that drafts k tokens and verifies them emits E(k) = 1 + sum_{j<=k} a_1 ... a_j tokens, a_i
being the chance the i-th draft is accepted given the ones before it were (this sequence's own, per
source and position: `Acceptance`). It costs its share of the forwards it runs, from the fitted cost
model (`kvlab.lossless.cost_model`):

    round_s(k) = k * draft_s + verify_s(k) + link_s      (staggered: max(k * draft_s, link_s) + verify_s(k))
    plain_s    = step_s + link_s

where a share is an equal part of its forward's fixed cost (the weights' read, split among the
segments that forward packs: every running sequence for the served weights, the sequences drafting
with a cheaper copy for theirs) plus the segment's own work (a draft on a cheaper copy beside other
sequences also keeps its share of the served weights' fixed cost: their forward runs every tick anyway,
the rounds of a batch being out of step), and `link_s` is its full KV over a
slower tier's link (0 in memory). The planner takes the source and k with the most tokens per second,
E(k) / round_s(k), or a plain step (k = 0) where 1 / plain_s is more; beside prompt lookup, a round drafts
from the compressed cache no more tokens than a lookup round proposes (`_forward_limit`). Sequences that
start their rounds in the same tick drafting from their compressed cache alone are planned as a group
(`start_group`): one length for all, the one with the most summed tokens over summed seconds (the batch's
goodput, as SmartSpec plans a batch step), so their draft forwards stay shared and their verifies land together.

Exploration is in the estimate, not in timed windows. Whether to draft at all is decided with each
a_i at its posterior mean plus `optimism` standard deviations; the length with half that optimism. So
where only the optimistic estimate says a source pays, the round is a short probe (the lengths lean
only a little), evidence ages while a source is not used (and a position while no round reaches it),
so a source that stopped being tried grows uncertain until such a probe is worth its expected cost
again. A new sequence starts from what
the run's rounds of the same drafter accepted so far (the drafter's own prior before any). A fixed
draft length (`num_draft_tokens=k`) only leaves the choice of source.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

from kvlab.generation.feed import RoundHost
from kvlab.lossless.cost_model import ForwardCostModel, SegmentShape
from kvlab.lossless.drafter import Drafter, Offer, RoundState
from kvlab.lossless.lengths import LENGTHS_PAST_THE_PEAK, Acceptance, choose_length

logger = logging.getLogger(__name__)

# A remote-prefix start drafts while its exact prefix is in transit: the wait is paid anyway, so the
# round drafts up to this many tokens (or its fixed length) and verifies once the prefix has landed.
TRANSIT_NUM_DRAFT_TOKENS = 8
MAX_TRACE = 256


class RoundSettings(Protocol):
    """The settings a plan reads (`kvlab.lossless.config.LosslessConfig`)."""

    @property
    def num_draft_tokens(self) -> int | str: ...

    @property
    def max_num_draft_tokens(self) -> int: ...

    @property
    def schedule(self) -> str: ...


class PlannedState(RoundState, Protocol):
    """What the planner reads of a lossless sequence (`kvlab.lossless.round.PlannedState`)."""

    drafters: list[Drafter]
    acceptance: dict[str, Acceptance]

    @property
    def settings(self) -> RoundSettings: ...

    def full_shape(self, num_tokens: int) -> SegmentShape: ...


@dataclasses.dataclass(frozen=True, slots=True)
class RoundPlan:
    """A round's decision.

    Attributes:
        offer: The drafter's offer taken (None: a plain step, drafting nothing).
        num_draft_tokens: Tokens to draft (0 with no offer).
        expected_tokens: Tokens the round is expected to emit.
        expected_s: Seconds of forwards the round is expected to cost this sequence.
        plain_s: What a plain step would cost this sequence instead.
    """

    offer: Offer | None
    num_draft_tokens: int
    expected_tokens: float
    expected_s: float
    plain_s: float

    @property
    def source(self) -> str:
        return "plain" if self.offer is None else self.offer.drafter.name


@dataclasses.dataclass(slots=True)
class BatchView:
    """What the planner knows of the batch it plans in: sequences running, those drafting now with
    weights of their own (they leave the served weights' forward for another one), and the sequences
    that plan their next rounds in this tick (`group`, by id of their state: host and state) with the
    plans made for them together (`group_plans`)."""

    num_running: int = 1
    drafting: dict[int, str] = dataclasses.field(default_factory=dict)  # id(state) -> weights
    group: dict[int, tuple[RoundHost, PlannedState]] = dataclasses.field(default_factory=dict)
    group_plans: dict[int, RoundPlan] = dataclasses.field(default_factory=dict)

    def num_sharing(self, weights: str, state: PlannedState) -> int:
        """Segments expected in the forward `state`'s segment on `weights` would join (itself included)."""
        others = {key: value for key, value in self.drafting.items() if key != id(state)}
        if weights == "same":
            return max(self.num_running - sum(w != "same" for w in others.values()), 1)
        return 1 + sum(w == weights for w in others.values())


@dataclasses.dataclass(slots=True)
class RoundPlanner:
    """Plans every lossless round of an engine (see the module docstring).

    Attributes:
        costs: The engine's fitted cost model.
        batch: The batch as of the last tick.
        optimism: Standard deviations added to each acceptance estimate (exploration).
        trace: The last MAX_TRACE decisions, for `--json` and debugging.
        num_plans: Rounds planned per source ("plain" for plain steps).
    """

    costs: ForwardCostModel
    batch: BatchView = dataclasses.field(default_factory=BatchView)
    optimism: float = 1.0
    trace: collections.deque[dict[str, Any]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=MAX_TRACE))
    num_plans: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    run_acceptance: dict[str, Acceptance] = dataclasses.field(default_factory=dict)

    def acceptance_of(self, state: PlannedState, offer: Offer) -> Acceptance:
        """`state`'s acceptance record of offers like `offer` (`Offer.acceptance_key`), made on first use: its
        prior is what the run's recent rounds of such offers accepted (the drafter's prior of that kind before
        any), and its rounds are credited at first with as many positions as the run's are."""
        key = offer.acceptance_key
        if key not in state.acceptance:
            run = self.run_acceptance.setdefault(key, Acceptance(offer.drafter.prior_of(offer.kind)))
            state.acceptance[key] = Acceptance(run.pooled()[0], min_credited=run.credited())
        return state.acceptance[key]

    def round_done(self, state: PlannedState, plan: RoundPlan, num_draft_tokens: int,
                   num_accepted_tokens: int) -> None:
        """`state`'s round is verified: it no longer holds a draft forward, and its acceptance counts."""
        self.batch.drafting.pop(id(state), None)
        if plan.offer is not None and num_draft_tokens:
            self.acceptance_of(state, plan.offer).update(num_draft_tokens, num_accepted_tokens)
            run = self.run_acceptance[plan.offer.acceptance_key]
            run.age()  # the run's recent rounds: a long-lived engine's workload changes
            run.update(num_draft_tokens, num_accepted_tokens)

    def start_group(self, members: list[tuple[RoundHost, PlannedState]]) -> None:
        """The sequences that plan their next rounds in this tick (their verifies or plain steps are in it, or
        they start): those that draft only from their compressed cache with `auto` lengths are planned
        together, one length for all, so they draft and verify in step."""
        self.batch.group = {id(state): (host, state) for host, state in members if _in_step(state)}
        self.batch.group_plans = {}

    def plan(self, host: RoundHost, state: PlannedState) -> RoundPlan:
        """The next round of `state`: the offer and length with the most expected tokens per second."""
        settings = state.settings
        limit = max(min(settings.max_num_draft_tokens, host.remaining() - 1), 0)
        fixed = None if settings.num_draft_tokens == "auto" else int(settings.num_draft_tokens)
        if state.in_transit:
            length = min(fixed or TRANSIT_NUM_DRAFT_TOKENS, max(host.remaining() - 1, 1))
            offer = state.drafters[-1].offer(host, state, length)
            return self._taken(state, RoundPlan(offer, length if offer else 0, 0.0, 0.0, 0.0))
        group = self.batch.group
        if id(state) in group and (len(group) > 1 or id(state) in self.batch.group_plans):
            if id(state) not in self.batch.group_plans:  # the group's first member to plan plans for all
                self.batch.group_plans = self._plan_group(list(group.values()))
            # Planned when the group's first member planned, before this one emitted its last round: its
            # remaining budget may have shrunk since (a round past it would count drafts never emitted).
            plan = _within(self.batch.group_plans.pop(id(state)), limit)
            del group[id(state)]
            _age_unused(state, plan)
            return self._taken(state, plan)
        if fixed is not None:
            limit = min(limit, fixed)
        plain_s = self._plain_s(state)
        best = RoundPlan(None, 0, 1.0, plain_s, plain_s)
        forward_limit = limit if fixed is not None else _forward_limit(state.drafters, limit)
        for drafter in state.drafters:
            offer = drafter.offer(host, state, limit if drafter.round_tokens is not None else forward_limit)
            if offer is None:
                continue
            candidate = self._best_length(state, offer, plain_s, fixed)
            if candidate is None:
                continue
            if (fixed is not None and best.offer is None) or _rate(candidate) > _rate(best):
                best = candidate
        _age_unused(state, best)
        return self._taken(state, best)

    def _taken(self, state: PlannedState, plan: RoundPlan) -> RoundPlan:
        self.num_plans[plan.source] += 1
        if plan.offer is not None and plan.offer.weights is not None and plan.num_draft_tokens:
            self.batch.drafting[id(state)] = plan.offer.weights
        decision = {"source": plan.source, "kind": plan.offer.kind if plan.offer else "", "k": plan.num_draft_tokens,
                    "expected_tokens": round(plan.expected_tokens, 2),
                    "expected_ms": round(plan.expected_s * 1e3, 2), "plain_ms": round(plan.plain_s * 1e3, 2),
                    "running": self.batch.num_running}
        self.trace.append(decision)
        logger.debug("round plan: %s", decision)
        return plan

    def _plain_s(self, state: PlannedState) -> float:
        full = state.full_shape(len(state.pending))
        return self.costs.share_s("same", full, self.batch.num_sharing("same", state)) + \
            self.costs.link_s(full.tier_bytes)

    def _best_length(self, state: PlannedState, offer: Offer, plain_s: float, fixed: int | None) -> RoundPlan | None:
        """The offer's best length (its only one when `fixed`), or None where it offers nothing."""
        if offer.max_tokens < 1:
            return None
        round_s = self._round_costs(state, offer)
        lengths = [min(fixed, offer.max_tokens)] if fixed is not None else range(1, offer.max_tokens + 1)
        choice = choose_length(self.acceptance_of(state, offer), lengths, round_s, plain_s,
                               self.optimism if fixed is None else 0.0)
        return RoundPlan(offer, choice.num_draft_tokens, choice.expected_tokens, choice.seconds, plain_s)

    def _round_costs(self, state: PlannedState, offer: Offer, num_in_step: int = 1) -> Callable[[int], float]:
        """Seconds a round of `state` drafting k tokens of `offer` costs it, as a function of k, when it drafts
        in step with `num_in_step` sequences (itself included) that share its draft forwards."""
        draft_s = 0.0
        if offer.weights is not None:
            draft = SegmentShape(1, offer.num_cached)
            sharing = self.batch.num_sharing(offer.weights, state)
            if offer.weights != "same":  # the served weights' forward already counts every running sequence
                sharing += num_in_step - 1
            draft_s = self.costs.share_s(offer.weights, draft, sharing)
            if offer.weights != "same" and self.batch.num_running > num_in_step:
                # The served weights' forward runs each tick for the others anyway: a row drafting on its own
                # weights leaves its share of that forward's fixed cost to them (their rounds out of step).
                draft_s += self.costs.share_s("same", SegmentShape(0, 0), self.batch.num_running)
        overlapped = state.settings.schedule == "staggered"
        sharing = self.batch.num_sharing("same", state)

        full = state.full_shape(len(state.pending))  # once: a verify adds only its drafts to it
        link_s = self.costs.link_s(full.tier_bytes)

        def round_s(length: int) -> float:
            verify = SegmentShape(full.num_tokens + length, full.num_cached, full.tier_bytes)
            drafting_s = length * draft_s
            return (max(drafting_s, link_s) if overlapped else drafting_s + link_s) + \
                self.costs.share_s("same", verify, sharing)

        return round_s

    def _plan_group(self, members: list[tuple[RoundHost, PlannedState]]) -> dict[int, RoundPlan]:
        """One length for sequences that plan together (each capped by what it may still draft), or plain steps
        for all: the length with the most expected tokens per second of the group, its members' tokens summed
        over their summed shares (SmartSpec's goodput of a batch step). Drafting in step keeps the group's
        draft ticks cheap and its verifies together: a member drafting while the others step plainly would need
        more ticks than they do and finish alone, with nobody to share the weights' read (measured at 8K, batch
        8: rounds out of step, 0.59x plain, two fifths of the time in ticks of fewer than eight)."""
        rows = []
        for host, state in members:
            limit = max(min(state.settings.max_num_draft_tokens, host.remaining() - 1), 0)
            offer = state.drafters[0].offer(host, state, limit)
            rows.append((state, offer, self._plain_s(state)))
        plain_rates = {id(state): RoundPlan(None, 0, 1.0, plain_s, plain_s) for state, _, plain_s in rows}
        drafting = [(state, offer, plain_s) for state, offer, plain_s in rows if offer is not None and offer.max_tokens]
        if not drafting:
            return plain_rates
        group_plain_s = sum(plain_s for _, _, plain_s in rows)
        longest = max(offer.max_tokens for _, offer, _ in drafting)  # type: ignore[union-attr]
        # Drafting in step, the members share their draft forwards (on their own weights: the served forward
        # then runs only where others keep it running).
        costs = [self._round_costs(state, offer, len(drafting)) for state, offer, _ in drafting]  # type: ignore[arg-type]
        # The group's tokens are a sum over its members: its optimistic bound is the sum's, one standard
        # deviation of which is sqrt(n) of one member's, not n of them (members' acceptances taken independent).
        optimism = self.optimism / math.sqrt(len(drafting))
        estimates = [
            [self.acceptance_of(state, offer).expected_tokens(offer.max_tokens, spread)  # type: ignore[arg-type,union-attr]
             for spread in (0.0, optimism / 2, optimism)]
            for state, offer, _ in drafting
        ]
        others = [plain_s for state, offer, plain_s in rows if offer is None or not offer.max_tokens]

        def group_round(length: int, which: int) -> tuple[float, float]:
            """(tokens, seconds) of a group round of `length` drafts (the mean, leaning or hoped tokens)."""
            tokens = float(len(others)) + sum(estimate[which][min(length, offer.max_tokens)]  # type: ignore[union-attr]
                                              for estimate, (_, offer, _) in zip(estimates, drafting, strict=True))
            seconds = sum(others) + sum(round_s(min(length, offer.max_tokens))  # type: ignore[union-attr]
                                        for round_s, (_, offer, _) in zip(costs, drafting, strict=True))
            return tokens, max(seconds, 1e-9)

        best_length, best_leaning = 0, 0.0
        for length in range(1, longest + 1):
            if best_length and length - best_length > LENGTHS_PAST_THE_PEAK:
                break
            tokens, seconds = group_round(length, 1)
            if tokens / seconds > best_leaning:
                best_length, best_leaning = length, tokens / seconds
        plain_rate = len(rows) / max(group_plain_s, 1e-9)
        mean_tokens, seconds = group_round(best_length, 0)
        hoped_tokens, _ = group_round(best_length, 2)
        if mean_tokens / seconds < plain_rate and hoped_tokens / seconds < plain_rate:
            return plain_rates
        credited = 0 if mean_tokens / seconds >= plain_rate else 2  # a probe is credited with its hoped tokens
        plans = dict(plain_rates)
        for (state, offer, plain_s), estimate, round_s in zip(drafting, estimates, costs, strict=True):
            length = min(best_length, offer.max_tokens)  # type: ignore[union-attr]
            plans[id(state)] = RoundPlan(offer, length, estimate[credited][length], round_s(length), plain_s)
        return plans


def _forward_limit(drafters: list[Drafter], limit: int) -> int:
    """The most tokens an `auto` round drafts forward by forward (from the compressed cache) beside drafters whose
    rounds have a size of their own (prompt lookup): no more than theirs. A cache round whose drafts are all
    accepted is copying its context, which the lookup then proposes without a forward once it matches a few
    tokens; a longer cache round pays draft forwards for what the lookup gives free. Measured on the 4K
    document at batch 1 (`ngram+snapkv-0.9`, served weights, docs/lossless.md): rounds of 15 to 24 cache drafts,
    chosen because their rate beat a plain step's, left `auto` at 0.73x and 0.75x the best fixed length (k=4);
    capped, 1.13x (over two repeats, 32.39 and 32.07 tokens/s against 25.20 and 22.30 before)."""
    sizes = [drafter.round_tokens for drafter in drafters if drafter.round_tokens is not None]
    return min([limit, *sizes])


def _within(plan: RoundPlan, limit: int) -> RoundPlan:
    """`plan` with at most `limit` drafts (a plain step where none may be drafted)."""
    if plan.num_draft_tokens <= limit:
        return plan
    if limit == 0:
        return RoundPlan(None, 0, 1.0, plan.plain_s, plan.plain_s)
    return dataclasses.replace(plan, num_draft_tokens=limit)


def _in_step(state: PlannedState) -> bool:
    """Whether a sequence's rounds can be planned in step with others': `auto` lengths from its compressed
    cache alone (a prompt-lookup round takes one tick whatever its length; a fixed length is fixed)."""
    return state.settings.num_draft_tokens == "auto" and len(state.drafters) == 1 and not state.in_transit


def _age_unused(state: PlannedState, plan: RoundPlan) -> None:
    """Every acceptance record of `state` that `plan` does not draft with counts its evidence a little less."""
    used = None if plan.offer is None else plan.offer.acceptance_key
    for key, acceptance in state.acceptance.items():
        if key != used:
            acceptance.age()


def _rate(plan: RoundPlan) -> float:
    return plan.expected_tokens / max(plan.expected_s, 1e-9)


