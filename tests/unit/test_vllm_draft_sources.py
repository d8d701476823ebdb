"""The vLLM proposer's choice between prompt lookup and the compressed cache (pure arithmetic)."""

from __future__ import annotations

from kvlab.integrations.vllm.sources import DraftCosts, SourceRecord, running_mean


def test_an_unmeasured_lookup_is_tried_first() -> None:
    assert SourceRecord().takes_lookup(DraftCosts(0.1, 0.04), 4)
    assert SourceRecord(lookup=1.0).takes_lookup(DraftCosts(None, None), 4), "costs unknown: try the free source"


def test_the_lookup_is_taken_while_its_rate_beats_the_caches() -> None:
    costs = DraftCosts(step_s=0.1, draft_forward_s=0.05)  # a cache round costs 0.1 + 4 * 0.05 = 0.3 s
    # Lookup 2 tokens per 0.1 s = 20/s; cache 5 per 0.3 s = 16.7/s (unmeasured: every draft accepted).
    assert SourceRecord(lookup=2.0).takes_lookup(costs, 4)
    # Lookup 1.2 per 0.1 s = 12/s < 16.7/s.
    assert not SourceRecord(lookup=1.2).takes_lookup(costs, 4)
    # A measured cache that emits 3 tokens a round (10/s) loses to that lookup.
    assert SourceRecord(lookup=1.2, cache=3.0).takes_lookup(costs, 4)


def test_rounds_are_credited_to_the_source_that_drafted_them() -> None:
    record = SourceRecord(pending="lookup")
    record.record(3)
    assert (record.lookup, record.cache, record.pending) == (3.0, None, None)
    record.pending = "cache"
    record.record(5)
    record.record(1)  # nothing pending: a step that drafted nothing
    assert (record.lookup, record.cache) == (3.0, 5.0)
    assert running_mean(None, 2.0) == 2.0 and 2.0 < running_mean(2.0, 4.0) < 4.0
