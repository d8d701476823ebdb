"""The engine on a tiny random model: its output equals the plain reference decoder in every mode, every
per-request setting is honoured per request, fetch-aware admission lets ready requests pass a slow
fetch, and a failing request fails alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvlab.compress import create_compressor
from kvlab.engine import Engine, EngineCallbacks, EngineConfig, Request, SinglePrefixSource, generate
from kvlab.engine import runner as engine_runner
from kvlab.generation import GenerationConfig, reference_generate
from kvlab.lossless import LosslessConfig
from kvlab.lossless import round as lossless_round
from kvlab.models import LoadedModel
from kvlab.store import create_store
from kvlab.store.prefix import PrefixCache, PrefixConfig
from tests.helpers import tiny_llama

CHUNK = 16
PROMPTS = [[5 + (i * 7 + j * 3) % 80 for j in range(20 + 9 * i)] for i in range(3)]
CONFIG = GenerationConfig(max_new_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=5)


def reference(model: LoadedModel, prompt: list[int], config: GenerationConfig = CONFIG, **kwargs: Any) -> list[int]:
    return reference_generate(model, [prompt], config, **kwargs).requests[0].token_ids


def run(engine: Engine, requests: list[Request]) -> list[int]:
    ids = [engine.add_request(request) for request in requests]
    while engine.num_unfinished():
        engine.step()
    return ids


def lossless(drafter: str = "snapkv", num_draft_tokens: int | str = 3, **kwargs: Any) -> LosslessConfig:
    return LosslessConfig(create_compressor(drafter, budget=12), num_draft_tokens, **kwargs)  # type: ignore[arg-type]


# ----- equal to the reference decoder


@pytest.mark.parametrize("mode", ["plain", "lossy", "lossless"])
def test_a_batch_in_every_mode_equals_the_reference_decoder_per_prompt(model: LoadedModel, mode: str) -> None:
    compressor = create_compressor("snapkv", budget=12) if mode == "lossy" else None
    engine = Engine(model)
    requests = [Request(p, CONFIG, compressor, lossless() if mode == "lossless" else None) for p in PROMPTS]
    for request_id, prompt in zip(run(engine, requests), PROMPTS, strict=True):
        expected = reference(model, prompt, compressor=compressor)
        assert engine.output(request_id).token_ids == expected, f"{mode} prompt {request_id} differs"


def test_plain_lossy_and_lossless_requests_share_ticks_and_each_equals_its_reference(model: LoadedModel) -> None:
    snapkv = create_compressor("snapkv", budget=12)
    engine = Engine(model, EngineConfig(interleave_prefill=True))
    requests = [
        Request(PROMPTS[0], CONFIG),
        Request(PROMPTS[1], CONFIG, snapkv),
        Request(PROMPTS[2], CONFIG, lossless=lossless()),
    ]
    ids = run(engine, requests)
    assert engine.output(ids[0]).token_ids == reference(model, PROMPTS[0])
    assert engine.output(ids[1]).token_ids == reference(model, PROMPTS[1], compressor=snapkv)
    assert engine.output(ids[2]).token_ids == reference(model, PROMPTS[2])
    assert engine.round_stats(ids[0]) is None and engine.round_stats(ids[1]) is None
    rounds = engine.round_stats(ids[2])
    assert rounds is not None and rounds.rounds > 0


def test_generate_equals_the_reference_decoder_with_stop_rules(model: LoadedModel) -> None:
    free = reference(model, PROMPTS[1], GenerationConfig(max_new_tokens=20, ignore_eos=True))
    model.model.generation_config.eos_token_id = free[7]
    try:
        config = GenerationConfig(max_new_tokens=20)
        output = generate(model, PROMPTS, config)
        for prompt, request in zip(PROMPTS, output.requests, strict=True):
            expected = reference_generate(model, [prompt], config).requests[0]
            assert (request.token_ids, request.stop_reason) == (expected.token_ids, expected.stop_reason)
        assert output.requests[1].stop_reason == "eos"
    finally:
        model.model.generation_config.eos_token_id = None


# ----- the public API


def test_cancel_frees_the_request_and_its_output_says_cancelled(model: LoadedModel) -> None:
    engine = Engine(model)
    long, short = (engine.add_request(Request(p, GenerationConfig(max_new_tokens=n, ignore_eos=True)))
                   for p, n in ((PROMPTS[0], 200), (PROMPTS[1], 6)))
    engine.step()
    engine.step()
    engine.cancel(long)
    assert engine.num_unfinished() == 1
    while engine.num_unfinished():
        engine.step()
    assert engine.output(long).stop_reason == "cancelled" and 0 < len(engine.output(long).token_ids) < 200
    assert engine.output(short).token_ids == reference(
        model, PROMPTS[1], GenerationConfig(max_new_tokens=6, ignore_eos=True)
    )
    engine.release(long)
    with pytest.raises(KeyError):
        engine.output(long)


def test_a_request_whose_prefill_fails_fails_alone(model: LoadedModel) -> None:
    engine = Engine(model)
    ids = run(engine, [Request(PROMPTS[0], CONFIG), Request([999] * 4, CONFIG), Request(PROMPTS[2], CONFIG)])
    assert engine.error(ids[1]) is not None, "token ids past the vocabulary must fail their request"
    for request_id, prompt in ((ids[0], PROMPTS[0]), (ids[2], PROMPTS[2])):
        assert engine.error(request_id) is None
        assert engine.output(request_id).token_ids == reference(model, prompt)


def test_streamed_tokens_are_the_output_and_arrive_per_request(model: LoadedModel) -> None:
    streamed: dict[int, list[int]] = {}
    progress: list[int] = []
    callbacks = EngineCallbacks(on_tokens=lambda i, tokens: streamed.setdefault(i, []).extend(tokens),
                                on_progress=progress.append)
    engine = Engine(model, callbacks=callbacks)
    ids = run(engine, [Request(p, CONFIG, lossless=lossless()) for p in PROMPTS])
    for request_id in ids:
        assert streamed[request_id] == engine.output(request_id).token_ids
    assert sum(progress) == sum(len(engine.output(i).token_ids) for i in ids)


# ----- every per-request setting honoured per request (two requests in one batch)


def record_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str, log: list[tuple[str, Any]]) -> None:
    original: Callable[..., Any] = getattr(module, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        log.append((name, args))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)


def forwards_between_each_load_and_its_verify(events: list[tuple[str, Any]], cache_id: int) -> list[int]:
    """For each full-KV load of the cache `cache_id`, the forwards that ran before the one reading it."""
    gaps, pending = [], None
    for name, args in events:
        if name == "request_loads" and id(args[0]) == cache_id:
            pending = 0
        elif name == "run_packed" and pending is not None:
            if cache_id in {id(segment.cache) for segment in args[1]}:
                gaps.append(pending)
                pending = None
            else:
                pending += 1
    return gaps


def test_each_request_keeps_its_own_schedule(model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """staggered queues the full-KV load at round start, so it overlaps the drafts; synchronous queues
    it right before the verify. Two requests, one of each, in one batch."""
    events: list[tuple[str, Any]] = []
    record_calls(monkeypatch, lossless_round, "request_loads", events)
    record_calls(monkeypatch, engine_runner, "run_packed", events)
    engine = Engine(model)
    settings = [
        lossless(num_draft_tokens=3, schedule="staggered"), lossless(num_draft_tokens=3, schedule="synchronous")
    ]
    ids = run(engine, [Request(PROMPTS[0], CONFIG, lossless=s) for s in settings])
    loaded_caches: list[int] = []  # the staggered request loads first: at its first round's start
    for name, args in events:
        if name == "request_loads" and id(args[0]) not in loaded_caches:
            loaded_caches.append(id(args[0]))
    assert len(loaded_caches) == 2
    staggered, synchronous = (forwards_between_each_load_and_its_verify(events, c) for c in loaded_caches)
    assert staggered and min(staggered) >= 1, f"staggered loads must overlap drafting: {staggered}"
    assert synchronous and set(synchronous) == {0}, f"synchronous loads come right before the verify: {synchronous}"
    for request_id in ids:
        assert engine.output(request_id).token_ids == reference(model, PROMPTS[0])


def test_each_request_keeps_its_own_draft_length(model: LoadedModel) -> None:
    engine = Engine(model)
    ids = run(engine, [Request(PROMPTS[1], CONFIG, lossless=lossless(num_draft_tokens=k)) for k in (2, 5)])
    for request_id, k in zip(ids, (2, 5), strict=True):
        rounds = engine.round_stats(request_id)
        assert rounds is not None
        # Every round drafts k tokens, except where fewer new tokens remain.
        assert max(rounds.num_draft_tokens_per_round) == k, rounds.num_draft_tokens_per_round
        assert engine.output(request_id).token_ids == reference(model, PROMPTS[1])


def test_each_request_keeps_its_own_drafter(model: LoadedModel) -> None:
    """Batched, each request's rounds are exactly the rounds it has alone with its own drafter."""
    drafters = ("snapkv", "streamingllm")
    alone = []
    for drafter in drafters:
        engine = Engine(model)
        (request_id,) = run(engine, [Request(PROMPTS[2], CONFIG, lossless=lossless(drafter, 4))])
        alone.append(engine.round_stats(request_id))
    assert alone[0] != alone[1], "the two drafters must draft differently for this test to mean anything"
    engine = Engine(model)
    ids = run(engine, [Request(PROMPTS[2], CONFIG, lossless=lossless(drafter, 4)) for drafter in drafters])
    for request_id, expected in zip(ids, alone, strict=True):
        rounds = engine.round_stats(request_id)
        assert rounds is not None and expected is not None
        assert (rounds.num_draft_tokens_per_round, rounds.accepted_per_position) == (
            expected.num_draft_tokens_per_round, expected.accepted_per_position)


def test_each_request_keeps_its_own_draft_weights(model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, Any]] = []
    record_calls(monkeypatch, engine_runner, "run_packed", events)
    engine = Engine(model)
    ids = run(engine, [Request(PROMPTS[0], CONFIG, lossless=lossless(draft_weights=w)) for w in ("same", "bf16")])
    bf16 = [args[1] for _, args in events if next(args[0].parameters()).dtype == torch.bfloat16]
    target = [args[1] for _, args in events if args[0] is model.model]
    assert bf16 and target
    bf16_caches = {id(segment.cache) for segments in bf16 for segment in segments}
    target_caches = {id(segment.cache) for segments in target for segment in segments}
    assert len(bf16_caches) == 1, "only the bf16 request's draft cache runs on the bf16 copy"
    assert len(target_caches) == 3, "the target runs the same-weights drafts and both verifies"
    for request_id in ids:
        assert engine.output(request_id).token_ids == reference(model, PROMPTS[0])


def stored_prefix(model: LoadedModel, prompts: list[list[int]], **config: Any) -> PrefixCache:
    prefix = PrefixCache.for_model(model, create_store("memory://"),
                                   PrefixConfig(chunk_tokens=CHUNK, allow_recompute=False, **config))
    generate(model, prompts, GenerationConfig(max_new_tokens=1, prefill_chunk_tokens=CHUNK), prefix=prefix)
    prefix.flush()
    return prefix


def test_each_request_keeps_its_own_prefix_draft_and_prefix_draft_chunks(model: LoadedModel) -> None:
    prompt = [(5 * i + 7) % 90 + 3 for i in range(80)]  # 5 chunks
    prefix = stored_prefix(model, [prompt], write=("exact", "int4"))
    fetches: list[tuple[tuple[str, ...] | None, list[int] | None]] = []
    fetch = prefix.fetch

    def recording_fetch(tokens: list[int], resolutions: tuple[str, ...] | None = None, chunks: list[int] | None = None):  # type: ignore[no-untyped-def]
        fetches.append((resolutions, chunks))
        return fetch(tokens, resolutions, chunks)

    prefix.fetch = recording_fetch  # type: ignore[method-assign]
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    settings = [
        lossless(prefix_draft="int4", prefix_draft_chunks=2), lossless(prefix_draft="int4", prefix_draft_chunks=None),
        lossless(),
    ]
    engine = Engine(model, prefixes=SinglePrefixSource(prefix))
    ids = run(engine, [Request(prompt, config, lossless=s) for s in settings])
    low_bit = [chunks for resolutions, chunks in fetches if resolutions == ("int4",)]
    assert low_bit == [[0, -1], None], "each remote start fetches its own window of low-bit chunks"
    exact = [resolutions for resolutions, _ in fetches if resolutions is not None and "int4" not in resolutions]
    assert len(exact) == 3, "two exact prefixes in transit and one prefill restore"
    assert engine.reused_tokens(ids[2]) == 4 * CHUNK and engine.reused_tokens(ids[0]) == 0
    expected = reference(model, prompt, config)
    for request_id in ids:
        assert engine.output(request_id).token_ids == expected


@pytest.mark.parametrize("prefix_draft", [None, "int4"])
@pytest.mark.parametrize("drafter", ["h2o", "snapkv_agnostic"])
def test_drafters_that_score_with_every_prompt_query_decode_prompts_restored_or_prefilled_in_pieces(
    model: LoadedModel, drafter: str, prefix_draft: str | None
) -> None:
    # A prompt prefilled in pieces, or restored from exact chunks, compresses with its last piece's
    # queries; a remote start (low-bit prefix) would compute only the prompt's last tokens, so these
    # compressors' requests are prefilled as usual instead.
    prompt = [(3 * i + 2) % 90 + 3 for i in range(80)]
    prefix = stored_prefix(model, [prompt], write=("exact", "int4"))
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    engine = Engine(model, prefixes=SinglePrefixSource(prefix))
    ids = run(engine, [Request(prompt, config, lossless=lossless(drafter, prefix_draft=prefix_draft))])
    output = engine.output(ids[0])
    assert output.stop_reason == "length" and output.token_ids == reference(model, prompt, config)


# ----- fetch-aware admission (moved from the removed FetchAwareScheduler's tests)


RELEASE_TIMEOUT_S = 30.0
"""How long a held fetch waits for the test to release it: a guard against hanging, never a measurement."""


def held_prefix(model: LoadedModel, prompt: list[int], release: threading.Event, events: list[tuple[str, Any]]
                ) -> PrefixCache:
    """`prompt`'s stored prefix, whose fetch waits until the test sets `release`: a fetch exactly as slow as
    the test needs, without a clock. The fetch appends `("fetched", released)` to `events` when it returns."""
    prefix = stored_prefix(model, [prompt])
    fetch = prefix.fetch

    def held_fetch(tokens: list[int], resolutions: tuple[str, ...] | None = None, chunks: list[int] | None = None):  # type: ignore[no-untyped-def]
        released = release.wait(RELEASE_TIMEOUT_S)
        events.append(("fetched", released))
        return fetch(tokens, resolutions, chunks)

    prefix.fetch = held_fetch  # type: ignore[method-assign]
    return prefix


@pytest.mark.parametrize("fetch_workers", [1, 0])
def test_requests_without_a_fetch_overtake_a_slow_fetch_only_when_fetching_in_the_background(
    model: LoadedModel, fetch_workers: int
) -> None:
    shared = [(5 * i + 7) % 90 + 3 for i in range(80)]
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    events: list[tuple[str, Any]] = []  # ("token", id), ("finished", id), ("fetched", released), in order
    release = threading.Event()
    if not fetch_workers:
        release.set()  # fetched inline on this thread: holding it would hold the test itself

    def on_tokens(request_id: int, tokens: list[int]) -> None:
        events.append(("token", request_id))

    engine = Engine(model, EngineConfig(max_num_seqs=4, interleave_prefill=True, fetch_workers=fetch_workers),
                    SinglePrefixSource(held_prefix(model, shared, release, events)),
                    EngineCallbacks(on_tokens=on_tokens))
    prompts = [shared + [9, 10]] + [[11 + i, 12, 13, 14] for i in range(3)]
    ids = [engine.add_request(Request(prompt, config)) for prompt in prompts]
    reuse, others = ids[0], ids[1:]
    while engine.num_unfinished():
        if not engine.has_work():
            time.sleep(0.001)  # only the background fetch is left: wait for it to land
        events.extend(("finished", request_id) for request_id in engine.step())
        if all(("finished", other) in events for other in others):
            release.set()  # the held fetch may return once every other request is done
    engine.close()
    fetched = next(index for index, (kind, _) in enumerate(events) if kind == "fetched")
    assert events[fetched] == ("fetched", True), f"the fetch was never released: the others never finished {events}"
    assert engine.reused_tokens(reuse) == 5 * CHUNK
    first_token = {request_id: events.index(("token", request_id)) for request_id in ids}
    if fetch_workers:
        finished = {other: events.index(("finished", other)) for other in others}
        assert all(finished[other] < fetched < first_token[reuse] for other in others), (
            f"the requests with nothing to fetch did not finish while the fetch was held: {events}")
    else:
        assert all(fetched < first_token[reuse] < first_token[other] for other in others), (
            f"an inline fetch must hold up the requests queued behind it: {events}")
    # Scheduling never changes what is generated.
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert engine.output(request_id).token_ids == reference(model, prompt, config)


def test_a_lossless_request_fetched_in_the_background_restores_exact_chunks_only(model: LoadedModel) -> None:
    prompt = [(5 * i + 7) % 90 + 3 for i in range(80)]
    prefix = stored_prefix(model, [prompt], write=("exact", "int8"), fetch=("int8", "exact"))
    asked: list[tuple[str, ...] | None] = []
    fetch = prefix.fetch

    def recording_fetch(tokens: list[int], resolutions: tuple[str, ...] | None = None, chunks: list[int] | None = None):  # type: ignore[no-untyped-def]
        asked.append(resolutions)
        return fetch(tokens, resolutions, chunks)

    prefix.fetch = recording_fetch  # type: ignore[method-assign]
    engine = Engine(model, EngineConfig(fetch_workers=1), SinglePrefixSource(prefix))
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    (request_id,) = run(engine, [Request(prompt, config, lossless=lossless())])
    engine.close()
    assert asked and all(resolutions is not None and "int8" not in resolutions for resolutions in asked), asked
    assert engine.reused_tokens(request_id) == 4 * CHUNK
    assert engine.output(request_id).token_ids == reference(model, prompt, config)


def test_a_long_lived_engine_keeps_per_request_figures_and_grows_no_totals(model: LoadedModel) -> None:
    prompt = [(5 * i + 7) % 90 + 3 for i in range(80)]
    prefix = stored_prefix(model, [prompt])
    engine = Engine(model, EngineConfig(aggregate_stats=False), SinglePrefixSource(prefix))
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    ids = run(engine, [Request(prompt, config, lossless=lossless()) for _ in range(3)])
    for request_id in ids:
        rounds = engine.round_stats(request_id)
        assert rounds is not None and rounds.rounds > 0 and engine.reused_tokens(request_id) == 4 * CHUNK
    assert engine.lossless_stats.num_draft_tokens_per_round == [] and engine.lossless_stats.rounds == 0
    assert engine.stats.prefix_fetches == [], "a server's engine must not keep a record per request"
