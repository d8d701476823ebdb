"""The fetch planner's arithmetic and the emulated link."""

from __future__ import annotations

import pytest

from kvlab.errors import ConfigError
from kvlab.store import create_store
from kvlab.store.backends.link import ThrottledStore, TokenBucket
from kvlab.store.prefix.planner import RECOMPUTE, ResolutionCost, choose_resolution, pipeline_seconds, plan_chunks
from tests.helpers import FakeClock

EXACT = ResolutionCost("exact", quality=3, nbytes=1000, decode_s=0.001)
INT8 = ResolutionCost("int8", quality=2, nbytes=300, decode_s=0.002)
INT4 = ResolutionCost("int4", quality=1, nbytes=150, decode_s=0.002)


def test_pipeline_overlaps_transfer_and_decode() -> None:
    assert pipeline_seconds([(1.0, 0.5)] * 4) == pytest.approx(4.5)  # transfer-bound: decode hides
    assert pipeline_seconds([(0.5, 1.0)] * 4) == pytest.approx(4.5)  # decode-bound: transfer hides
    assert pipeline_seconds([(1.0, 0.0)] * 2, latency_s=0.25) == pytest.approx(2.5)
    assert pipeline_seconds([]) == 0.0


def test_fast_link_keeps_the_exact_resolution() -> None:
    # At 10 MB/s exact costs 0.1 ms of transfer; decode dominates every option and exact decodes fastest.
    assert choose_resolution([EXACT, INT8, INT4], 1e7, quality_slack=0.1).name == "exact"


def test_slow_link_picks_the_smallest_and_near_ties_go_to_quality() -> None:
    assert choose_resolution([EXACT, INT8, INT4], 1e4, quality_slack=0.1).name == "int4"
    # With a 2.5x slack int8 (0.03 s) counts as tied with int4 (0.015 s) and wins on quality.
    assert choose_resolution([EXACT, INT8, INT4], 1e4, quality_slack=2.5).name == "int8"


def test_recompute_wins_when_fetching_is_slower() -> None:
    options = [[EXACT]] * 4
    assert plan_chunks(options, [0.01] * 4, bandwidth_bytes_per_s=1e3) == [RECOMPUTE] * 4
    assert plan_chunks(options, [10.0] * 4, bandwidth_bytes_per_s=1e3) == ["exact"] * 4
    assert plan_chunks(options, [0.01] * 4, bandwidth_bytes_per_s=1e3, allow_recompute=False) == ["exact"] * 4


def test_fetching_stops_at_the_first_chunk_not_stored() -> None:
    plan = plan_chunks([[EXACT], [], [EXACT]], [1.0] * 3, bandwidth_bytes_per_s=1e6)
    assert plan == ["exact", RECOMPUTE, RECOMPUTE]


def test_the_cut_balances_fetch_and_recompute() -> None:
    # Fetching costs 1 s a chunk; recomputing the first two would take 5 s each, the last 0.5 s.
    plan = plan_chunks([[EXACT]] * 3, [5.0, 5.0, 0.5], bandwidth_bytes_per_s=1e3)
    assert plan == ["exact", "exact", RECOMPUTE]


def test_token_bucket_charges_transfers_at_its_rate() -> None:
    # 1000 bytes/s and a 500-byte burst: every wait below is an exact binary fraction of a second.
    clock = FakeClock()
    bucket = TokenBucket(rate=1000, burst=500, clock=clock, sleep=clock.sleep)
    assert bucket.take(500) == 0.0 and clock.slept == [], "the burst is free"
    assert bucket.take(1500) == 1.5 and clock.slept == [1.5], "1500 bytes past the burst take 1.5 s at 1000 B/s"
    # The sleep paid the debt and no more: the next transfer starts from an empty bucket.
    assert bucket.take(250) == 0.25 and clock.slept == [1.5, 0.25]
    clock.now += 60.0  # idle for a minute: the bucket refills to its burst, not to 60000 bytes
    assert bucket.take(500) == 0.0 and bucket.take(1) == 1e-3, "an idle bucket saves up no more than its burst"
    with pytest.raises(ConfigError):
        TokenBucket(rate=0, burst=1)


def test_throttled_store_counts_bytes_and_passes_data_through() -> None:
    store = ThrottledStore(create_store("memory://"), bits_per_s=8e9)
    store.put("a", b"x" * 100)
    assert store.get("a") == b"x" * 100 and store.get("b") is None
    assert store.bytes_read == 100 and store.bytes_written == 100 and store.keys() == ["a"]
