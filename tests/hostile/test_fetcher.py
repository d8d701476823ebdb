"""Every hostile stored value ends the fetch at its chunk: identical output by recompute, one log line."""

from __future__ import annotations

import logging

import pytest

from kvlab.engine import generate
from kvlab.models import LoadedModel
from kvlab.store.prefix import PrefixCache
from tests.helpers import decode_fetching_in_background
from tests.hostile.conftest import CASES, CHUNK, CONFIG, OTHER, SECRET, VICTIM, plant, prefix_config


def modes(case: str) -> list[bytes | None]:
    # Without a secret a moved authentic chunk cannot be told from the real one: that is what the secret is for.
    return [SECRET] if case == "swapped_chunk" else [None, SECRET]


@pytest.mark.parametrize(("case", "secret"), [(case, secret) for case in CASES for secret in modes(case)],
                         ids=lambda value: "secret" if value == SECRET else "no-secret" if value is None else value)
def test_hostile_value_is_recomputed_with_one_log_line(
    victim_model: LoadedModel, case: str, secret: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    planted = plant(victim_model, case, secret)
    reader = PrefixCache.for_model(victim_model, planted.store, prefix_config(), planted.sealer)
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        output = generate(victim_model, [VICTIM], CONFIG, prefix=reader)
    assert output.requests[0].token_ids == planted.expected, f"{case}: output differs from recomputation"
    assert output.stats.prefix_reused_tokens == CHUNK, f"{case}: only the genuine chunk 0 may be reused"
    fetch = output.stats.prefix_fetches[0]
    assert fetch.faults == 1 and fetch.failed_key == planted.key and fetch.failure
    assert sum(reader.fault_counts.values()) == 1
    faults = [record.getMessage() for record in caplog.records if record.name == "kvlab.store"]
    assert len(faults) == 1 and planted.key in faults[0] and "chunk 1 of 2" in faults[0], faults


def test_a_swapped_chunk_fails_authentication(victim_model: LoadedModel) -> None:
    planted = plant(victim_model, "swapped_chunk", SECRET)
    reader = PrefixCache.for_model(victim_model, planted.store, prefix_config(), planted.sealer)
    reader.fetch(VICTIM)
    assert reader.fault_counts == {"auth": 1}


def test_an_unsealed_value_is_refused_when_a_secret_is_set(victim_model: LoadedModel) -> None:
    planted = plant(victim_model, "swapped_chunk", SECRET)
    other_key = PrefixCache.for_model(
        victim_model, planted.store, prefix_config(), planted.sealer
    ).keys(OTHER, "exact")[1]
    stored = planted.store.get(other_key)
    assert stored is not None
    planted.store.put(planted.key, bytes(planted.sealer.open(other_key, stored)))  # the bytes without the tag
    reader = PrefixCache.for_model(victim_model, planted.store, prefix_config(), planted.sealer)
    output = generate(victim_model, [VICTIM], CONFIG, prefix=reader)
    assert output.requests[0].token_ids == planted.expected and reader.fault_counts == {"auth": 1}


def test_a_writer_with_the_secret_replaces_a_planted_value(victim_model: LoadedModel) -> None:
    planted = plant(victim_model, "swapped_chunk", SECRET)
    healer = PrefixCache.for_model(victim_model, planted.store, prefix_config(), planted.sealer)
    generate(victim_model, [VICTIM], CONFIG, prefix=healer)  # falls back at chunk 1, recomputes and saves it
    healer.close()
    reader = PrefixCache.for_model(victim_model, planted.store, prefix_config(), planted.sealer)
    output = generate(victim_model, [VICTIM], CONFIG, prefix=reader)
    assert output.stats.prefix_reused_tokens == 2 * CHUNK and not reader.fault_counts
    assert output.requests[0].token_ids == planted.expected


@pytest.mark.parametrize("case", CASES)
def test_fetch_aware_admission_finishes_every_request_over_a_hostile_value(
    victim_model: LoadedModel,
    case: str,
) -> None:
    planted = plant(victim_model, case, SECRET)
    reader = PrefixCache.for_model(victim_model, planted.store, prefix_config(), planted.sealer)
    prompts = [VICTIM, [11, 12, 13, 14], VICTIM]
    engine, ids = decode_fetching_in_background(victim_model, reader, prompts, CONFIG)
    assert [engine.output(i).token_ids for i in ids] == [  # type: ignore[attr-defined]
        planted.expected, generate(victim_model, [[11, 12, 13, 14]], CONFIG).requests[0].token_ids, planted.expected]
