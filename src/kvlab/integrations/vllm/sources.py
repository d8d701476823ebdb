"""Which source drafts each row of a vLLM step, and how many tokens: kvlab's planner, adapted to vLLM.

Each row keeps kvlab's `Acceptance` of its compressed cache's drafts; prompt lookup's acceptance is kept per
length of the n-gram a proposal matched, shared by the rows (`LookupAcceptance`); both are updated from the
tokens vLLM accepted of a row's last proposal. A step's choice is made for all rows together with the shared
`choose_length` (`kvlab.lossless.lengths`), from one fitted `ForwardCostModel` of both forwards a round
runs (`StepCosts`):
- vLLM's step, which verifies every row in one forward: each row is a segment of its proposal and the
  token it sampled, after its context. A row's plain step costs its share of that step; a round of k
  drafts costs the share of a k + 1 token segment, so a lookup's drafts are free to propose but not to
  verify (fitted at 4K, batch 1: a verify of 4 drafts at about 1.3 plain steps, docs/vllm.md);
- the proposer's packed draft forwards, whose cost the rows drafting from the compressed cache together
  split.
A row whose best round does not beat its plain step proposes nothing (vLLM then runs a plain step for it).
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab.cache import KVCache
from kvlab.lossless.calibration import fastest_packed
from kvlab.lossless.compressed_cache import CompressedCacheDrafter
from kvlab.lossless.cost_model import ForwardCostModel, SegmentShape
from kvlab.lossless.lengths import Acceptance, choose_length
from kvlab.lossless.prompt_lookup import LookupMatch, PromptLookup

LOOKUP, CACHE = "prompt_lookup", "compressed_cache"
# The cost model's name for vLLM's step (the draft forwards go under the draft weights' name).
VLLM_STEP = "vllm"
# vLLM steps fitted before the plan trusts the fit. Until then rows propose rounds of every length from 0
# to the most, in turn, from their lookups (`bootstrap_plans`): steps where every row
# proposed its full round cannot tell a verify's cost from a plain step's, and a fit that priced verifies
# wrongly kept every row plain for the rest of a request, so it never saw another verify (measured at 4K,
# batch 1 and 4: 115 of 124 and 445 of 484 row steps proposed nothing).
MIN_STEPS_FITTED = 8
# Rounds a row's adoption (window, compression, check: about 0.25 s for a 4K prompt, 0.5 s for 6.4K) is spread
# over when a plan prices a row's first round from its cache: a row that adopts is expected to draft from its
# cache again. Priced as free, adoption made rows take one cache round each: at batch 8 on a 6.4K prompt all
# 8 were adopted for 46 cache row steps (3.9 s of a 22.8 s decode span).
ADOPTION_ROUNDS = 16
# Rows and kept tokens of the packed draft forwards `StepCosts.calibrate_drafts` times on the proposer's first
# call (the kept tokens of a compressed cache: a SnapKV budget of 512 keeps 512).
CALIBRATION_ROWS = (1, 2, 4, 8)
CALIBRATION_KEPT_TOKENS = (256, 1024)


@dataclasses.dataclass(slots=True)
class RowRecord:
    """A sequence's acceptance of its compressed cache's drafts, and the round vLLM verifies next.

    Attributes:
        cache: The acceptance of its cache's drafts.
        pending: (the acceptance the round counts in, tokens proposed) of the round vLLM verifies next (None:
            it proposed nothing).
    """

    cache: Acceptance = dataclasses.field(default_factory=lambda: Acceptance(CompressedCacheDrafter.prior_acceptance))
    pending: tuple[Acceptance, int] | None = None

    def record(self, num_emitted: int) -> None:
        """The pending round emitted `num_emitted` tokens (vLLM's sampled tokens of the row: accepted + 1)."""
        if self.pending is not None:
            acceptance, num_drafted = self.pending
            acceptance.update(num_drafted, min(num_emitted - 1, num_drafted))
        self.pending = None


@dataclasses.dataclass(slots=True)
class LookupAcceptance:
    """Prompt lookup's acceptance per n of the n-gram its proposal matched, shared by every row: a longer
    match is accepted far more often (`kvlab.lossless.prompt_lookup.LookupMatch`), so one estimate for all
    matches would let 1-gram matches hide the 3-gram ones that pay; and the rows of a batch learn it together."""

    by_ngram: dict[int, Acceptance] = dataclasses.field(default_factory=dict)

    def of(self, ngram: int) -> Acceptance:
        """The acceptance of proposals that matched an `ngram`-gram."""
        return self.by_ngram.setdefault(ngram, Acceptance(PromptLookup.prior_of_match(ngram)))

    def age_unused(self, used: set[int]) -> None:
        """A step that verified no proposal of these n-grams: their evidence counts a little less."""
        for ngram, acceptance in self.by_ngram.items():
            if ngram not in used:
                acceptance.age()


@dataclasses.dataclass(slots=True)
class StepCosts:
    """What a vLLM step and the proposer's draft forwards cost: kvlab's cost model fitted to both.

    Attributes:
        weights: The draft weights the proposer's forwards run.
        forwards: The fit of vLLM's steps (`VLLM_STEP`: each timed from one propose call's end to the next
            one's start) and of the proposer's packed draft forwards (`weights`).
        num_bootstrap_steps: Steps planned before both were fitted (`bootstrap_plans`).
    """

    weights: str
    forwards: ForwardCostModel = dataclasses.field(default_factory=ForwardCostModel)
    num_bootstrap_steps: int = 0

    def ready(self) -> bool:
        """Whether both forwards have been fitted (vLLM's step over MIN_STEPS_FITTED steps)."""
        steps = self.forwards.fits.get(VLLM_STEP)
        return steps is not None and steps.num_observed >= MIN_STEPS_FITTED and self.forwards.ready(self.weights)

    def observe_step(self, rows: list[SegmentShape], seconds: float) -> None:
        """vLLM's step over `rows` (each: its proposal + 1 tokens after its context) took `seconds`."""
        self.forwards.observe_tick([(VLLM_STEP, rows, seconds)])

    def observe_draft(self, rows: list[SegmentShape], seconds: float, calibration: bool = False) -> None:
        """One packed draft forward over `rows` took `seconds` (`calibration`: a forward `calibrate_drafts` ran)."""
        self.forwards.observe_tick([(self.weights, rows, seconds)], calibration=calibration)

    def calibrate_drafts(self, model: torch.nn.Module, caches_by_length: list[list[KVCache]]) -> None:
        """Fit the draft forward before any row drafts: packed forwards over 1, 2, 4 and 8 of each list's caches
        (synthetic ones of a few kept lengths), each the faster of two, rolled back. Without it the bootstrap
        adopted a row to draft from its cache on alternate turns, and adopting costs 0.3-0.4 s of a request's
        decode (docs/vllm.md)."""
        for caches in caches_by_length:
            for num_rows in CALIBRATION_ROWS:
                seconds, shapes = fastest_packed(model, caches[:num_rows], 0)
                self.observe_draft(shapes, seconds, calibration=True)


@dataclasses.dataclass(frozen=True, slots=True)
class RowPlan:
    """A row's proposal for this step: its source (None: nothing) and how many tokens."""

    source: str | None
    num_draft_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class StepRows:
    """The rows of one vLLM step as its plan sees them, each list in row order.

    Attributes:
        records: Each row's cache acceptance and pending round.
        lookups: Each row's prompt lookup match (no tokens where none, or no lookup).
        cached: Tokens each row's draft cache holds (what a draft forward attends over).
        contexts: Tokens whose KV vLLM holds for each row before the step (what its verify attends over).
        adopt_s: Seconds each row's adoption would still cost before its cache drafts (0 once adopted).
    """

    records: list[RowRecord]
    lookups: list[LookupMatch]
    cached: list[int]
    contexts: list[int]
    adopt_s: list[float]


def plan_rows(rows: StepRows, max_tokens: int, costs: StepCosts, lookup_acceptance: LookupAcceptance,
              optimism: float = 1.0) -> list[RowPlan]:
    """Each row's source and length for one vLLM step.

    Args:
        rows: The step's rows.
        max_tokens: vLLM's `num_speculative_tokens`.
        costs: The fitted model of vLLM's steps and of the proposer's draft forwards.
        lookup_acceptance: Prompt lookup's acceptance per matched n-gram length.
        optimism: Standard deviations of exploration (`choose_length`).
    """
    if not costs.ready():
        costs.num_bootstrap_steps += 1
        return bootstrap_plans([match.token_ids for match in rows.lookups], max_tokens, costs.num_bootstrap_steps)
    # The rows drafting from their caches share each draft forward: first taken as those without a lookup,
    # then as the rows that chose the cache.
    sharing = max(sum(not match.token_ids for match in rows.lookups), 1)
    plans = _plan_step(rows, max_tokens, costs, lookup_acceptance, optimism, sharing)
    in_cache = max(sum(plan.source == CACHE for plan in plans), 1)
    if in_cache != sharing:
        plans = _plan_step(rows, max_tokens, costs, lookup_acceptance, optimism, in_cache)
    for record, plan in zip(rows.records, plans, strict=True):
        if plan.source != CACHE:
            record.cache.age()
    lookup_acceptance.age_unused({match.ngram for match, plan in zip(rows.lookups, plans, strict=True)
                                  if plan.source == LOOKUP})
    return plans


def _plan_step(rows: StepRows, max_tokens: int, costs: StepCosts, lookup_acceptance: LookupAcceptance,
               optimism: float, num_cache_rows: int) -> list[RowPlan]:
    """`plan_rows`' choice for every row, `num_cache_rows` rows sharing each draft forward."""
    num_rows = len(rows.records)
    plans = []
    for record, match, num_cached, context, adopt_s in zip(rows.records, rows.lookups, rows.cached, rows.contexts,
                                                           rows.adopt_s, strict=True):
        def verify_s(length: int, context: int = context) -> float:
            return costs.forwards.share_s(VLLM_STEP, SegmentShape(length + 1, context), num_rows)

        plain_s = verify_s(0)
        best, best_rate = RowPlan(None, 0), 1.0 / max(plain_s, 1e-9)
        if match.token_ids:
            choice = choose_length(lookup_acceptance.of(match.ngram), range(1, len(match.token_ids) + 1), verify_s,
                                   plain_s, optimism)
            if choice.rate > best_rate:
                best, best_rate = RowPlan(LOOKUP, choice.num_draft_tokens), choice.rate
        draft_s = costs.forwards.share_s(costs.weights, SegmentShape(1, num_cached), num_cache_rows)
        first_s = adopt_s / ADOPTION_ROUNDS
        # A row is adopted only where its cache's expected rate pays, never to explore: exploring cost an
        # adoption (0.4 s, 9 of vLLM's plain steps) for a few rounds that lost (document, batch 1, 8 drafts).
        choice = choose_length(record.cache, range(1, max_tokens + 1),
                               lambda length, draft_s=draft_s, first_s=first_s:  # type: ignore[misc]
                               verify_s(length) + length * draft_s + first_s,
                               plain_s, optimism if adopt_s == 0 else 0.0)
        if choice.rate > best_rate:
            best = RowPlan(CACHE, choice.num_draft_tokens)
        plans.append(best)
    return plans


def bootstrap_plans(lookups: list[list[int]], max_tokens: int, step: int) -> list[RowPlan]:
    """Rows' plans while vLLM's step is not fitted: row i of step `step` proposes (step + i) mod
    (max_tokens + 1) tokens of its lookup (0, or no lookup: nothing). Never the compressed cache: its draft
    forward is fitted on synthetic caches before the first plan (`StepCosts.calibrate_drafts`), and a row
    drafting from it would first be adopted (0.25 to 0.5 s) only to be timed."""
    plans = []
    for index, lookup in enumerate(lookups):
        length = min((step + index) % (max_tokens + 1), len(lookup))
        plans.append(RowPlan(LOOKUP, length) if length else RowPlan(None, 0))
    return plans


def fixed_plans(lookups: list[list[int]], max_tokens: int) -> list[RowPlan]:
    """`fixed`: every row proposes `max_tokens`, its lookup's continuation where it has one, else the cache's."""
    return [RowPlan(LOOKUP, len(lookup)) if lookup else RowPlan(CACHE, max_tokens) for lookup in lookups]
