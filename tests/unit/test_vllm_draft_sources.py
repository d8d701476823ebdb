"""The vLLM proposer's per-row choice of source and length (kvlab's planner, adapted: pure arithmetic)."""

from __future__ import annotations

import pytest

from kvlab.integrations.vllm.sources import (
    ADOPTION_ROUNDS,
    CACHE,
    CALIBRATION_ROWS,
    LOOKUP,
    LookupAcceptance,
    RowPlan,
    RowRecord,
    StepCosts,
    StepRows,
    bootstrap_plans,
    fixed_plans,
    plan_rows,
)
from kvlab.lossless.cost_model import SegmentShape
from kvlab.lossless.lengths import Acceptance
from kvlab.lossless.prompt_lookup import LookupMatch
from tests.helpers import tiny_llama


def fitted(step_s: float, draft_forward_s: float, verify_token_s: float = 0.0, num_rows: int = 1) -> StepCosts:
    """vLLM steps over `num_rows` rows of `step_s` plus `verify_token_s` per proposed token, and draft forwards of
    `draft_forward_s` whatever they pack."""
    costs = StepCosts("int8")
    for proposed in (0, 1, 2, 4, 0, 3, 1, 4, 2, 0, 4, 3):
        rows = [SegmentShape(proposed + 1, 100)] * num_rows
        costs.observe_step(rows, step_s + verify_token_s * proposed * num_rows)
        costs.observe_draft([SegmentShape(1, 100)], draft_forward_s)
    return costs


def record(num_drafted: int, num_emitted: int, rounds: int, acceptance: Acceptance | None = None) -> RowRecord:
    """A row whose last `rounds` rounds of `num_drafted` drafts emitted `num_emitted` tokens each, counted in
    `acceptance` (default: its cache's)."""
    row = RowRecord()
    for _ in range(rounds):
        row.pending = (acceptance or row.cache, num_drafted)
        row.record(num_emitted)
    return row


def step(records: list[RowRecord], lookups: list[list[int]], num_cached: int = 100, ngram: int = 3,
         adopt_s: float = 0.0) -> StepRows:
    """A step of `records` with these lookup proposals (each an `ngram`-gram match), caches and contexts of
    `num_cached` tokens, each row's adoption still costing `adopt_s`."""
    matches = [LookupMatch(tokens, ngram if tokens else 0) for tokens in lookups]
    num_rows = len(records)
    return StepRows(records, matches, [num_cached] * num_rows, [num_cached] * num_rows, [adopt_s] * num_rows)


def test_before_the_costs_are_fitted_rows_propose_every_length_of_their_lookup_in_turn() -> None:
    """Never the cache: a row would be adopted (0.25 to 0.5 s) only to time a draft forward the proposer fits
    on synthetic caches before its first plan."""
    for lookup, lengths in (([5, 6, 7, 8], {0, 1, 2, 3, 4}), ([5, 6], {0, 1, 2}), ([], {0})):
        costs = StepCosts("int8")
        plans = [plan_rows(step([RowRecord()], [lookup]), 4, costs, LookupAcceptance())[0] for _ in range(10)]
        assert {plan.num_draft_tokens for plan in plans} == lengths
        assert {plan.source for plan in plans} == ({LOOKUP, None} if lookup else {None})
        assert all((plan.source is None) == (plan.num_draft_tokens == 0) for plan in plans)
        assert costs.num_bootstrap_steps == 10


def test_the_bootstrap_staggers_the_rows_lengths() -> None:
    """Rows of one step propose different lengths, so that a few steps show the fit several verify shapes."""
    lookups = [[5, 6, 7, 8]] * 4
    for number in range(10):
        lengths = [plan.num_draft_tokens for plan in bootstrap_plans(lookups, 4, number)]
        assert lengths == [(number + row) % 5 for row in range(4)]


def test_a_row_not_adopted_yet_takes_its_cache_only_where_the_adoption_is_worth_it() -> None:
    """Drafts accepted 4 of 4 at 10 ms a draft forward beside a 100 ms step: an adopted row drafts from its
    cache; one whose adoption would cost 16 s (1 s a round over ADOPTION_ROUNDS) does not."""
    accepted = record(4, 5, rounds=30)
    adopted = plan_rows(step([accepted], [[]]), 4, fitted(0.1, 0.01), LookupAcceptance())
    dear = plan_rows(step([accepted], [[]], adopt_s=ADOPTION_ROUNDS * 1.0), 4, fitted(0.1, 0.01), LookupAcceptance())
    assert adopted == [RowPlan(CACHE, 4)] and dear == [RowPlan(None, 0)], (adopted, dear)


def test_a_row_is_adopted_only_where_its_cache_is_expected_to_pay_never_to_explore() -> None:
    """A cache never tried (its prior), 90 ms a draft forward beside a 100 ms step: only the optimistic estimate
    beats a plain step. An adopted row probes its cache; a row not adopted yet does not pay an adoption for it,
    however cheap."""
    costs = fitted(0.1, 0.09)
    adopted = plan_rows(step([RowRecord()], [[]]), 4, costs, LookupAcceptance())
    not_yet = plan_rows(step([RowRecord()], [[]], adopt_s=0.0016), 4, costs, LookupAcceptance())
    assert adopted[0].source == CACHE and not_yet == [RowPlan(None, 0)], (adopted, not_yet)


def test_the_draft_forward_is_fitted_on_synthetic_caches_so_the_bootstrap_adopts_no_row() -> None:
    from kvlab.integrations.vllm.adoption import synthetic_caches

    model = tiny_llama()
    caches = [synthetic_caches(model, kept, max(CALIBRATION_ROWS)) for kept in (16, 64)]
    costs = StepCosts("same")
    costs.calibrate_drafts(model.model, caches)
    assert costs.forwards.ready("same") and not costs.ready()  # vLLM's steps are fitted as they come
    fitted_rows = 2 * len(CALIBRATION_ROWS) - costs.forwards.warm_up  # the first forward pays one-off set-ups
    assert len(costs.forwards.calibration["same"]) == fitted_rows
    assert [cache.seq_lengths[0] for cache in caches[1]] == [64] * max(CALIBRATION_ROWS)  # rolled back
    plans = [plan_rows(step([RowRecord(), RowRecord()], [[5, 6, 7, 8], []]), 4, costs, LookupAcceptance())
             for _ in range(10)]
    assert [{plan[row].source for plan in plans} for row in range(2)] == [{LOOKUP, None}, {None}]


def test_a_fixed_length_takes_the_lookup_where_it_has_one_else_the_cache() -> None:
    assert fixed_plans([[5, 6, 7], []], 4) == [RowPlan(LOOKUP, 3), RowPlan(CACHE, 4)]


def test_a_row_whose_cache_drafts_are_never_accepted_proposes_nothing() -> None:
    rejected = record(4, 1, rounds=30)
    plans = plan_rows(step([rejected], [[]]), 4, fitted(0.1, 0.05), LookupAcceptance())
    assert plans == [RowPlan(None, 0)]


def test_a_row_whose_drafts_are_accepted_drafts_long_from_the_cache() -> None:
    accepted = record(4, 5, rounds=30)
    plans = plan_rows(step([accepted], [[]]), 4, fitted(0.1, 0.01), LookupAcceptance())
    assert plans == [RowPlan(CACHE, 4)]


def test_rows_drafting_together_split_the_draft_forward() -> None:
    """A draft forward of 120 ms is too dear for one row of a 100 ms step whose first draft is accepted and the
    second not (2 tokens in 220 ms against 1 in 100), not when eight rows draft together (15 ms each)."""
    half = record(2, 2, rounds=30)  # the first of two drafts accepted, the second not
    alone = plan_rows(step([half], [[]]), 2, fitted(0.1, 0.12), LookupAcceptance())
    rows = [record(2, 2, rounds=30) for _ in range(8)]
    together = plan_rows(step(rows, [[]] * 8), 2, fitted(0.8, 0.12, num_rows=8), LookupAcceptance())
    assert alone == [RowPlan(None, 0)] and all(plan.source == CACHE for plan in together), (alone, together)


def test_a_free_lookup_is_taken_over_nothing_and_a_round_credits_its_source() -> None:
    lookups = LookupAcceptance()
    plans = plan_rows(step([RowRecord()], [[1, 2]]), 4, fitted(0.1, 1.0), lookups)
    assert plans == [RowPlan(LOOKUP, 2)]
    row = RowRecord(pending=(lookups.of(3), 3))
    row.record(3)  # two of three accepted
    assert lookups.of(3).accepted[:2] == [1.0, 1.0] and lookups.of(3).reached == [1.0, 1.0, 1.0]
    assert row.pending is None and row.cache.reached == [] and lookups.of(1).reached == []


def test_a_lookup_is_judged_by_what_matches_of_its_length_were_accepted() -> None:
    """1-gram matches that are never accepted do not keep a 3-gram match, accepted every time, from being
    proposed; and the 1-gram match itself is not proposed where its verify costs more than it is worth."""
    lookups = LookupAcceptance()
    for _ in range(40):
        lookups.of(1).update(2, 0)
        lookups.of(3).update(2, 2)
    costs = fitted(0.1, 1.0, verify_token_s=0.03)
    weak, strong = (plan_rows(step([RowRecord()], [[7, 8]], ngram=n), 2, costs, lookups)[0] for n in (1, 3))
    assert (weak, strong) == (RowPlan(None, 0), RowPlan(LOOKUP, 2)), (weak, strong)


def test_a_long_match_never_tried_is_taken_over_a_cache_that_drafts_well() -> None:
    """A row whose cache had every draft of 8 accepted, at 25 ms a draft forward beside a 54 ms step: its first
    8-gram match (prior: the output is copying) is proposed, a 1-gram match is not. With one prior for every
    match, the cache's learned rate beat an 8-gram's prior, so its matches were never tried (measured in vLLM,
    document at batch 1: 13 cache rounds at 25 ms a draft forward, no 8-gram proposed)."""
    costs = fitted(0.054, 0.025, verify_token_s=0.0035)
    plans = [plan_rows(step([record(8, 9, rounds=30)], [[7] * 8], ngram=n), 8, costs, LookupAcceptance())[0]
             for n in (1, 8)]
    assert [plan.source for plan in plans] == [CACHE, LOOKUP], plans


def test_a_lookup_whose_verify_costs_more_than_its_tokens_are_worth_is_not_proposed() -> None:
    """Lookup drafts cost no forward, but vLLM verifies them: at 60 ms a proposed token on a 100 ms step, a lookup
    whose first draft is accepted one time in five (1.2 tokens for 160 ms) loses to a plain step; at 5 ms it pays."""
    lookups = LookupAcceptance()
    poor = record(1, 1, rounds=40, acceptance=lookups.of(3))
    for _ in range(10):
        poor.pending = (lookups.of(3), 1)
        poor.record(2)
    dear = plan_rows(step([poor], [[7, 8]]), 2, fitted(0.1, 1.0, verify_token_s=0.06), lookups)
    cheap = plan_rows(step([poor], [[7, 8]]), 2, fitted(0.1, 1.0, verify_token_s=0.005), lookups)
    assert dear == [RowPlan(None, 0)] and cheap[0].source == LOOKUP, (dear, cheap)


def test_the_draft_length_setting_is_auto_or_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlab.errors import ConfigError
    from kvlab.integrations.vllm.proposer import DRAFT_LENGTH_ENV, draft_length_from_environment

    monkeypatch.delenv(DRAFT_LENGTH_ENV, raising=False)
    assert draft_length_from_environment() == "auto"
    monkeypatch.setenv(DRAFT_LENGTH_ENV, "fixed")
    assert draft_length_from_environment() == "fixed"
    monkeypatch.setenv(DRAFT_LENGTH_ENV, "8")
    with pytest.raises(ConfigError, match="auto, fixed"):
        draft_length_from_environment()
