"""The vLLM proposer's per-row choice of source and length (kvlab's planner, adapted: pure arithmetic)."""

from __future__ import annotations

import pytest

from kvlab.integrations.vllm.sources import CACHE, LOOKUP, RowPlan, RowRecord, StepCosts, plan_rows, running_mean
from kvlab.lossless.cost_model import SegmentShape


def fitted(step_s: float, draft_forward_s: float) -> StepCosts:
    """A vLLM step of `step_s` and draft forwards of `draft_forward_s` whatever they pack."""
    costs = StepCosts("int8", step_s=step_s)
    for _ in range(4):
        costs.draft.observe_tick([("int8", [SegmentShape(1, 100)], draft_forward_s)])
    return costs


def record(source: str, num_drafted: int, num_emitted: int, rounds: int) -> RowRecord:
    row = RowRecord()
    for _ in range(rounds):
        row.pending = (source, num_drafted)
        row.record(num_emitted)
    return row


def test_before_anything_is_measured_the_lookup_is_tried_where_it_has_a_proposal() -> None:
    plans = plan_rows([RowRecord(), RowRecord()], [[5, 6, 7], []], [100, 100], 4, StepCosts("int8"))
    assert plans == [RowPlan(LOOKUP, 3), RowPlan(CACHE, 4)]


def test_a_row_whose_cache_drafts_are_never_accepted_proposes_nothing() -> None:
    rejected = record(CACHE, 4, 1, rounds=30)
    plans = plan_rows([rejected], [[]], [100], 4, fitted(0.1, 0.05))
    assert plans == [RowPlan(None, 0)]


def test_a_row_whose_drafts_are_accepted_drafts_long_from_the_cache() -> None:
    accepted = record(CACHE, 4, 5, rounds=30)
    plans = plan_rows([accepted], [[]], [100], 4, fitted(0.1, 0.01))
    assert plans == [RowPlan(CACHE, 4)]


def test_rows_drafting_together_split_the_draft_forward() -> None:
    """A draft forward of 120 ms is too dear for one row of a 100 ms step whose first draft is accepted and the
    second not (2 tokens in 220 ms against 1 in 100), not when eight rows draft together (15 ms each)."""
    half = record(CACHE, 2, 2, rounds=30)  # the first of two drafts accepted, the second not
    alone = plan_rows([half], [[]], [100], 2, fitted(0.1, 0.12))
    rows = [record(CACHE, 2, 2, rounds=30) for _ in range(8)]
    together = plan_rows(rows, [[]] * 8, [100] * 8, 2, fitted(0.8, 0.12))
    assert alone == [RowPlan(None, 0)] and all(plan.source == CACHE for plan in together), (alone, together)


def test_a_free_lookup_is_taken_over_nothing_and_a_round_credits_its_source() -> None:
    plans = plan_rows([RowRecord()], [[1, 2]], [100], 4, fitted(0.1, 1.0))
    assert plans == [RowPlan(LOOKUP, 2)]
    row = RowRecord(pending=(LOOKUP, 3))
    row.record(3)  # two of three accepted
    assert row.acceptance[LOOKUP].accepted[:2] == [1.0, 1.0] and row.acceptance[LOOKUP].reached == [1.0, 1.0, 1.0]
    assert row.pending is None and row.acceptance[CACHE].reached == []
    assert running_mean(None, 2.0) == 2.0 and 2.0 < running_mean(2.0, 4.0) < 4.0


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
