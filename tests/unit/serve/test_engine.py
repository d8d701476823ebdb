"""The continuous-batching engine on a tiny random model: outputs equal offline decoding whatever joins
or leaves the batch, prefill interleaves with decoding, limits and cancellation free rows."""

from __future__ import annotations

import queue
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvlab.compress import compressors
from kvlab.engine import Request
from kvlab.generation import GenerationConfig, reference_generate
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import EngineClosedError, ServeEngine, ServerBusyError
from kvlab.serve.request import Event, FailedEvent, FinishedEvent, ServeRequest, TokensEvent
from tests.helpers import tiny_llama

PROMPTS = [[5 + (i * 7 + j * 3) % 80 for j in range(20 + 6 * i)] for i in range(4)]


class Collector:
    """Events of every request, in the order the engine sent them."""

    def __init__(self) -> None:
        self.log: list[tuple[int, Event]] = []
        self.done: dict[int, queue.Queue[Event]] = {}
        self.lock = threading.Lock()

    def sink(self, tag: int) -> queue.Queue[Event]:
        self.done[tag] = queue.Queue()

        def receive(event: Event) -> None:
            with self.lock:
                self.log.append((tag, event))
            if not isinstance(event, TokensEvent):
                self.done[tag].put(event)

        self._sinks = getattr(self, "_sinks", {})
        self._sinks[tag] = receive
        return self.done[tag]

    def wait(self, tag: int, timeout: float = 60.0) -> Event:
        return self.done[tag].get(timeout=timeout)


def make_request(collector: Collector, tag: int, prompt: list[int], config: GenerationConfig, mode: str = "plain",
                 drafter: str = "snapkv", draft_length: int | str = 3) -> ServeRequest:
    collector.sink(tag)
    compressor = None if mode == "plain" else compressors.create(drafter, budget=12)
    lossless = None
    if mode == "lossless":
        assert compressor is not None
        lossless = LosslessConfig(compressor, draft_length)  # type: ignore[arg-type]
    request = Request(prompt, config, compressor if mode == "lossy" else None, lossless)
    return ServeRequest(request, collector._sinks[tag])


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return tiny_llama()


@pytest.fixture
def engine(loaded: LoadedModel) -> Iterator[ServeEngine]:
    engine = ServeEngine(loaded, ServeConfig(max_num_seqs=3, max_queued_requests=2, prefill_chunk_tokens=8),
                         LosslessConfig(compressors.create("snapkv", budget=12)))
    yield engine
    engine.shutdown()


def offline(loaded: LoadedModel, prompt: list[int], config: GenerationConfig, mode: str) -> list[int]:
    """The plain reference decoder's output (lossless decoding's greedy output is the plain one)."""
    compressor = compressors.create("snapkv", budget=12) if mode == "lossy" else None
    return reference_generate(loaded, [prompt], config, compressor=compressor).requests[0].token_ids


@pytest.mark.parametrize("mode", ["plain", "lossy", "lossless"])
def test_greedy_outputs_equal_offline_decoding_while_requests_join_and_leave(
    engine: ServeEngine, loaded: LoadedModel, mode: str
) -> None:
    collector = Collector()
    configs = [GenerationConfig(max_new_tokens=6 + 5 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    # More requests than running slots: the fourth joins when the first leaves.
    for tag, (prompt, config) in enumerate(zip(PROMPTS, configs, strict=True)):
        engine.submit(make_request(collector, tag, prompt, config, mode))
        time.sleep(0.01 * tag)
    for tag, (prompt, config) in enumerate(zip(PROMPTS, configs, strict=True)):
        event = collector.wait(tag)
        assert isinstance(event, FinishedEvent), event
        expected = offline(loaded, prompt, config, mode)
        assert event.output.token_ids == expected, f"{mode} request {tag} differs from offline decoding"
        streamed = [t for tag_, e in collector.log if tag_ == tag and isinstance(e, TokensEvent) for t in e.token_ids]
        # The last tokens travel with the finished event, so a stream ends on them.
        assert event.last_token_ids, f"request {tag}: its last tokens did not come with its finished event"
        assert streamed + event.last_token_ids == expected, f"request {tag}: streamed tokens differ from the output"
    assert engine.engine.num_unfinished() == 0


def test_mixed_modes_share_the_batch_and_each_equals_its_offline_output(
    engine: ServeEngine,
    loaded: LoadedModel,
) -> None:
    collector = Collector()
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    modes = ["plain", "lossless", "lossy"]
    for tag, mode in enumerate(modes):
        engine.submit(make_request(collector, tag, PROMPTS[tag], config, mode))
    for tag, mode in enumerate(modes):
        event = collector.wait(tag)
        assert isinstance(event, FinishedEvent)
        assert event.output.token_ids == offline(loaded, PROMPTS[tag], config, mode), f"{mode} request differs"
        if mode == "lossless":
            assert event.stats.rounds > 0 and event.stats.acceptance_length >= 1.0
            assert event.stats.num_accepted_tokens <= event.stats.num_draft_tokens


def test_a_long_prefill_is_chunked_so_running_requests_keep_streaming(engine: ServeEngine) -> None:
    collector = Collector()
    engine.submit(make_request(collector, 0, PROMPTS[0], GenerationConfig(max_new_tokens=60, ignore_eos=True)))
    while not any(tag == 0 for tag, _ in collector.log):
        time.sleep(0.001)
    long_prompt = [7 + i % 80 for i in range(64)]  # 8 pieces of 8 tokens
    with collector.lock:
        submitted_at = len(collector.log)
    engine.submit(make_request(collector, 1, long_prompt, GenerationConfig(max_new_tokens=2, ignore_eos=True)))
    assert isinstance(collector.wait(1), FinishedEvent)
    with collector.lock:
        order = [tag for tag, event in collector.log[submitted_at:] if isinstance(event, TokensEvent)]
    during_prefill = order[: order.index(1)].count(0)
    # One decode tick per prefill piece: 8 pieces let the running request emit about 8 times.
    assert during_prefill >= 7, (
        f"the running request got {during_prefill} token events during an 8-piece prefill: decoding did not interleave"
    )
    assert isinstance(collector.wait(0), FinishedEvent)


def test_a_cancelled_request_leaves_the_batch_and_frees_its_row(engine: ServeEngine) -> None:
    collector = Collector()
    request = make_request(collector, 0, PROMPTS[1], GenerationConfig(max_new_tokens=400, ignore_eos=True), "lossless")
    engine.submit(request)
    while not any(tag == 0 for tag, _ in collector.log):
        time.sleep(0.001)
    assert engine.metrics.registry.get_sample_value(
        "kvlab:num_requests_running", {"model_name": engine.loaded.name}
    ) == 1
    engine.cancel(request)
    deadline = time.monotonic() + 10
    while engine.num_in_system() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.num_in_system() == 0
    assert engine.engine.num_unfinished() == 0, "the cancelled sequence (and its caches) is still in the engine"
    assert engine.metrics.registry.get_sample_value(
        "kvlab:num_requests_running", {"model_name": engine.loaded.name}
    ) == 0
    assert collector.done[0].empty(), "a cancelled request must get no further events"


def test_seeded_sampling_is_reproducible_per_request_whatever_shares_the_batch(engine: ServeEngine) -> None:
    sampled = GenerationConfig(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    outputs = []
    for neighbours in (0, 2):
        collector = Collector()
        for tag in range(neighbours):
            engine.submit(make_request(
                collector, 10 + tag, PROMPTS[tag + 1], GenerationConfig(max_new_tokens=8, seed=tag, temperature=1.0)
            ))
        for mode_tag, mode in ((0, "plain"), (1, "lossless")):
            engine.submit(make_request(collector, mode_tag, PROMPTS[0], sampled, mode))
        results = []
        for tag in (0, 1):
            event = collector.wait(tag)
            assert isinstance(event, FinishedEvent)
            results.append(event.output.token_ids)
        for tag in range(neighbours):
            collector.wait(10 + tag)
        outputs.append(results)
    assert outputs[0] == outputs[1], "a seeded request sampled differently beside other requests"


def test_requests_beyond_the_batch_and_the_queue_are_refused(loaded: LoadedModel) -> None:
    engine = ServeEngine(
        loaded, ServeConfig(max_num_seqs=1, max_queued_requests=1), LosslessConfig(compressors.create("snapkv"))
    )
    collector = Collector()
    long = GenerationConfig(max_new_tokens=300, ignore_eos=True)
    first, second = make_request(collector, 0, PROMPTS[0], long), make_request(collector, 1, PROMPTS[1], long)
    engine.submit(first)
    engine.submit(second)
    with pytest.raises(ServerBusyError, match="1 running, 1 queued"):
        engine.submit(make_request(collector, 2, PROMPTS[2], long))
    engine.shutdown()
    assert isinstance(collector.wait(0), FailedEvent), "shutdown without a grace period cancels running requests"
    with pytest.raises(EngineClosedError):
        engine.submit(make_request(collector, 3, PROMPTS[3], long))


def run_one(engine: ServeEngine, prompt: list[int], config: GenerationConfig, mode: str = "lossless") -> FinishedEvent:
    collector = Collector()
    engine.submit(make_request(collector, 0, prompt, config, mode))
    event = collector.wait(0)
    assert isinstance(event, FinishedEvent), event
    return event


def test_a_stored_prefix_is_fetched_before_prefill_and_changes_no_token(loaded: LoadedModel) -> None:
    config = ServeConfig(prefix_store="memory://", prefix_chunk_tokens=8)
    engine = ServeEngine(loaded, config, LosslessConfig(compressors.create("snapkv", budget=12)))
    try:
        generation = GenerationConfig(max_new_tokens=8, ignore_eos=True)
        first = run_one(engine, PROMPTS[0], generation)
        assert engine.prefixes is not None
        engine.prefixes.get(None).flush()
        second = run_one(engine, PROMPTS[0], generation)
        assert (first.stats.cached_tokens, second.stats.cached_tokens) == (0, 16), (
            "20 tokens hold 2 reusable 8-token chunks"
        )
        assert second.output.token_ids == first.output.token_ids == offline(loaded, PROMPTS[0], generation, "lossless")
        assert engine.metrics.registry.get_sample_value(
            "kvlab:prefix_fetched_tokens_total", {"model_name": loaded.name}
        ) == 16
    finally:
        engine.shutdown()


def test_a_store_that_cannot_be_reached_costs_reuse_not_completion(loaded: LoadedModel) -> None:
    from tests.helpers import free_port

    config = ServeConfig(prefix_store=f"redis://127.0.0.1:{free_port()}/0?timeout=0.5", prefix_chunk_tokens=8)
    engine = ServeEngine(loaded, config, LosslessConfig(compressors.create("snapkv", budget=12)))
    try:
        generation = GenerationConfig(max_new_tokens=8, ignore_eos=True)
        for mode in ("plain", "lossless"):
            event = run_one(engine, PROMPTS[1], generation, mode)
            assert event.stats.cached_tokens == 0
            assert event.output.token_ids == offline(loaded, PROMPTS[1], generation, mode), f"{mode} output changed"
    finally:
        engine.shutdown()


RELEASE_TIMEOUT_S = 30.0
"""How long a held read waits for the test to release it: a guard against hanging, never a measurement."""


class HeldReads:
    """A store whose reads wait until the test sets `release` (a link exactly as slow as the test needs,
    without a clock); lookups stay fast. `waits` records, per read, whether the test released it."""

    def __init__(self, inner: object, release: threading.Event) -> None:
        self.inner, self.release = inner, release
        self.waits: list[bool] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def get(self, key: str, *args: object, **kwargs: object) -> bytes | None:
        self.waits.append(self.release.wait(RELEASE_TIMEOUT_S))
        return self.inner.get(key, *args, **kwargs)  # type: ignore[attr-defined, no-any-return]


def test_a_request_waiting_for_its_fetch_does_not_block_the_queue(loaded: LoadedModel) -> None:
    config = ServeConfig(prefix_store="memory://", prefix_chunk_tokens=8, max_num_seqs=2)
    engine = ServeEngine(loaded, config, LosslessConfig(compressors.create("snapkv", budget=12)))
    try:
        assert engine.prefixes is not None
        release = threading.Event()
        release.set()  # the first run stores the prompt's chunks unheld
        held = HeldReads(engine.prefixes.store, release)
        engine.prefixes.store = held  # type: ignore[assignment]
        generation = GenerationConfig(max_new_tokens=4, ignore_eos=True)
        run_one(engine, PROMPTS[2], generation, "plain")
        engine.prefixes.get(None).flush()
        release.clear()
        held.waits.clear()
        collector = Collector()
        engine.submit(make_request(collector, 0, PROMPTS[2], generation))  # its 3 stored chunks' reads are held
        engine.submit(make_request(collector, 1, PROMPTS[3], generation))  # nothing stored: ready at once
        fresh = collector.wait(1)  # while request 0's reads are held
        release.set()
        fetched = collector.wait(0)
        assert isinstance(fetched, FinishedEvent) and isinstance(fresh, FinishedEvent)
        assert held.waits and all(held.waits), (
            f"request 0's reads were not all released by the test ({held.waits}): request 1 did not finish while "
            "they were held")
        assert fetched.stats.cached_tokens == 24, "32 tokens hold 3 reusable 8-token chunks"
        with collector.lock:
            finished_order = [tag for tag, event in collector.log if isinstance(event, FinishedEvent)]
        assert finished_order == [1, 0], "the request that needed no fetch waited behind the one fetching"
        assert fetched.output.token_ids == offline(loaded, PROMPTS[2], generation, "plain")
    finally:
        engine.shutdown()


def poisoned_seed() -> tuple[list[int], GenerationConfig]:
    # The seed is validated by GenerationConfig; forced past it, it reaches the engine thread, where
    # torch's generator would refuse a seed of 2**64: it must fail only its own request.
    config = GenerationConfig(max_new_tokens=4, temperature=0.5)
    object.__setattr__(config, "seed", 1 << 64)
    return PROMPTS[1], config


def poisoned_prompt() -> tuple[list[int], GenerationConfig]:
    return [999] * 4, GenerationConfig(max_new_tokens=4)  # ids past the vocabulary: the prefill raises


@pytest.mark.parametrize(("poison", "kind"), [(poisoned_seed, "invalid"), (poisoned_prompt, "error")])
def test_a_request_that_fails_in_the_engine_fails_alone_and_the_others_go_on(
    engine: ServeEngine, loaded: LoadedModel, poison: Any, kind: str
) -> None:
    collector = Collector()
    good = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    engine.submit(make_request(collector, 0, PROMPTS[0], good))
    engine.submit(make_request(collector, 1, *poison()))
    engine.submit(make_request(collector, 2, PROMPTS[2], good))
    failed = collector.wait(1)
    assert isinstance(failed, FailedEvent) and failed.kind == kind, failed
    for tag in (0, 2):
        event = collector.wait(tag)
        assert isinstance(event, FinishedEvent), f"request {tag} did not finish beside the failed one: {event}"
        assert event.output.token_ids == offline(loaded, PROMPTS[tag], good, "plain")
    assert engine.healthy and engine.failure is None
    assert isinstance(run_one(engine, PROMPTS[3], good, "plain"), FinishedEvent), "a later request hung"


def test_an_engine_thread_that_dies_fails_its_requests_reports_unhealthy_and_refuses_more(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    died = threading.Event()
    engine = ServeEngine(loaded, ServeConfig(max_num_seqs=2), LosslessConfig(compressors.create("snapkv")),
                         on_failure=died.set)
    collector = Collector()
    running = make_request(collector, 0, PROMPTS[0], GenerationConfig(max_new_tokens=400, ignore_eos=True))
    engine.submit(running)
    while not any(tag == 0 for tag, _ in collector.log):
        time.sleep(0.001)

    def broken_step() -> None:
        raise MemoryError("simulated: the engine itself broke")

    monkeypatch.setattr(engine.engine, "step", broken_step)
    event = collector.wait(0)
    assert isinstance(event, FailedEvent) and "the engine failed" in event.message, event
    assert died.wait(10), "on_failure was not called: the server would keep answering /health ok"
    assert not engine.healthy and engine.failure is not None and "MemoryError" in engine.failure
    with pytest.raises(EngineClosedError, match="engine failed"):
        engine.submit(make_request(collector, 1, PROMPTS[1], GenerationConfig(max_new_tokens=4)))
    engine.shutdown()


@pytest.mark.parametrize(("stop_reason", "error"), [("error", "RuntimeError: a forward failed"), ("cancelled", None)])
def test_a_request_the_engine_stopped_on_a_failure_gets_a_failed_event_never_a_finish(
    engine: ServeEngine, monkeypatch: pytest.MonkeyPatch, stop_reason: str, error: str | None
) -> None:
    # The engine's account of a failed request: its stop reason and message (`RequestOutput.error`),
    # with no exception object to read.
    real_output = engine.engine.output
    failing = PROMPTS[2]

    def output(request_id: int) -> Any:
        produced = real_output(request_id)
        if produced.prompt_token_ids != failing:
            return produced
        return types.SimpleNamespace(prompt_token_ids=failing, token_ids=produced.token_ids, text=produced.text,
                                     stop_reason=stop_reason, error=error, logprobs=None, prompt_logprobs=None)

    monkeypatch.setattr(engine.engine, "output", output)
    monkeypatch.setattr(engine.engine, "error", lambda request_id: None)
    collector = Collector()
    good = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    engine.submit(make_request(collector, 0, PROMPTS[0], good))
    engine.submit(make_request(collector, 1, failing, good))
    failed = collector.wait(1)
    assert isinstance(failed, FailedEvent) and failed.kind == "error", f"a failed request was delivered as {failed}"
    assert (error or repr(stop_reason)) in failed.message, failed.message
    assert isinstance(collector.wait(0), FinishedEvent), "the request beside the failed one did not finish"
    sample = engine.metrics.registry.get_sample_value
    model = engine.loaded.name
    assert sample("kvlab:request_failure_total", {"model_name": model, "reason": "error"}) == 1
    assert sample("kvlab:request_failure_total", {"model_name": model, "reason": "cancelled"}) is None
    assert sample("kvlab:request_success_total", {"model_name": model, "finished_reason": "length"}) == 1
    assert sample("kvlab:request_success_total", {"model_name": model, "finished_reason": stop_reason}) is None


def test_the_no_secret_warning_is_said_once_however_many_cache_salts(
    loaded: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("KVLAB_STORE_SECRET", "KVLAB_STORE_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    config = ServeConfig(prefix_store=f"file://{tmp_path}", prefix_chunk_tokens=8, max_cache_salts=2)
    engine = ServeEngine(loaded, config, LosslessConfig(compressors.create("snapkv", budget=12)))
    try:
        assert engine.prefixes is not None
        for salt in (None, "tenant-a", "tenant-b", "tenant-c", None):  # past max_cache_salts: caches reopen
            engine.prefixes.get(salt)
    finally:
        engine.shutdown()
    said = [record for record in caplog.records if "not authenticated" in record.getMessage()]
    assert len(said) == 1, f"the no-secret warning was said {len(said)} times for one store"
