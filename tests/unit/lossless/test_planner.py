"""The round planner and its cost model: the model recovers known costs, the planner takes plain steps where
drafting cannot pay and drafts where it does, at batch 1 and 8, and whatever it decides the output is the
plain output."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

import pytest
import torch

from kvlab.attention_kernels import newest_kernel_queries
from kvlab.cache import Segment
from kvlab.compress import create_compressor
from kvlab.engine import Engine, Request
from kvlab.engine import runner as engine_runner
from kvlab.engine import tick as engine_tick
from kvlab.generation import GenerationConfig, reference_generate
from kvlab.generation.feed import Feed, RoundHost
from kvlab.lossless import LosslessConfig, PromptLookup
from kvlab.lossless import round as round_module
from kvlab.lossless.cost_model import ForwardCostModel, LinearFit, SegmentShape, features
from kvlab.lossless.drafter import Drafter, Offer, Proposal
from kvlab.lossless.lengths import Acceptance, choose_length
from kvlab.lossless.planner import RoundPlanner
from kvlab.lossless.round import LosslessState
from tests.helpers import tiny_llama
from tests.unit.lossless.scripted import ScriptedCosts
from tests.unit.lossless.test_lossless import DRAFTERS, _prompts
from tests.unit.lossless.test_prompt_lookup import repetitive_prompt


def test_the_fit_recovers_known_coefficients_from_synthetic_ticks() -> None:
    truth = torch.tensor([0.020, 0.0005, 0.002, 0.006, 0.002, 0.003, 0.001], dtype=torch.float64)
    fit = LinearFit(forgetting=1.0, ridge=1e-9)
    generator = torch.Generator().manual_seed(0)
    # Plain steps and drafts (one query), verifies (2 to 17: the kernel takes up to 6) and prefill pieces.
    num_tokens = torch.tensor([1, 1, 1, *range(2, 18), 256, 512])
    for _ in range(80):
        num_segments = int(torch.randint(1, 9, (1,), generator=generator))
        picks = torch.randint(0, len(num_tokens), (num_segments,), generator=generator)
        segments = [SegmentShape(int(num_tokens[pick]), int(torch.randint(0, 8192, (1,), generator=generator)))
                    for pick in picks]
        x = features(segments, kernel_queries=6)
        fit.observe(x, float(torch.dot(truth, torch.tensor(x, dtype=torch.float64))))
    torch.testing.assert_close(fit.coefficients, truth, rtol=1e-4, atol=1e-7)


def test_a_verify_the_kernel_takes_is_priced_with_the_steps_and_a_longer_one_apart() -> None:
    step, short, long, piece = (SegmentShape(1, 999), SegmentShape(6, 994), SegmentShape(7, 993),
                                SegmentShape(100, 900))
    assert features([step, short, long, piece], kernel_queries=6) == [
        1.0, 114.0, 2.0, 2.0, 5 * 1000 / 1e5, 6 * 1000 / 1e5, 99 * 1000 / 1e5]
    # Where the kernel does not run, every segment of several queries reads its keys by the other paths.
    assert features([step, short, long], kernel_queries=1) == [1.0, 14.0, 1.0, 2.0, 0.0, 11 * 1000 / 1e5, 0.0]
    costs = ForwardCostModel(kernel_queries=6)
    costs.fits["same"] = LinearFit()
    costs.fits["same"].observe(features([short], 6), 0.01)
    assert costs.forward_s("same", [short]) == costs.fits["same"].predict(features([short], 6))


def test_the_fit_keeps_coefficients_non_negative() -> None:
    fit = LinearFit()
    for tokens in (1, 9, 17):
        fit.observe(features([SegmentShape(tokens, 1000)]), 0.05 - 0.001 * tokens)  # fewer seconds with more tokens
    assert bool((fit.coefficients >= 0).all()), fit.coefficients


def test_the_model_reports_its_out_of_sample_error_and_skips_warm_up() -> None:
    model = ForwardCostModel(warm_up=1)
    shape = [SegmentShape(1, 100)]
    model.observe_tick([("same", shape, 5.0)])  # a first forward's set-ups: neither fitted nor compared
    assert not model.ready("same") and model.fit.num_ticks == 0
    for _ in range(5):
        model.observe_tick([("same", shape, 0.1)])
    assert model.fit.num_ticks == 4 and model.forward_s("same", shape) == pytest.approx(0.1, rel=0.05)
    assert model.fit.mean_relative_error < 0.3
    model.link_bytes_per_s = 2e9
    assert model.link_s(10**9) == pytest.approx(0.5) and model.link_s(0) == 0.0


def test_expected_tokens_follow_acceptance_per_position() -> None:
    sure = Acceptance(0.5)
    for _ in range(50):
        sure.update(4, 4)
    expected = sure.expected_tokens(4, optimism=0.0)
    assert expected[0] == 1.0 and expected[4] > 4.5
    never = Acceptance(0.5)
    for _ in range(50):
        never.update(4, 0)
    assert never.expected_tokens(4, optimism=0.0)[4] < 1.1
    # Evidence ages while a source is aside: the optimistic estimate grows until a round is worth a try.
    before = never.expected_tokens(2, optimism=1.0)[2]
    for _ in range(60):
        never.age()
    assert never.expected_tokens(2, optimism=1.0)[2] > before + 0.2


def test_rounds_are_credited_only_up_to_twice_the_positions_with_evidence() -> None:
    # Five drafts of five accepted: the pooled estimate is high, but positions no round reached are not
    # credited past twice the frontier, however optimistic (a round of 64 was probed for 63 tokens).
    record = Acceptance(0.9)
    assert record.credited() == record.min_credited
    record.update(5, 5)
    assert record.credited() == 10
    hoped = record.expected_tokens(64, optimism=1.0)
    assert hoped[10] > 9.0 and hoped[64] == hoped[10]
    # A choice over every length then stops at the credited positions.
    choice = choose_length(record, range(1, 65), lambda k: 0.01 * k + 0.05, plain_s=0.05, optimism=1.0)
    assert choice.num_draft_tokens <= 10
    # The frontier recedes as positions go unreached (aged below half a round), and grows by doubling.
    for _ in range(20):
        record.update(2, 0)
    assert record.credited() < 10
    for _ in range(3):
        record.update(record.credited(), record.credited())
    assert record.credited() >= 16
    # A sequence joining a run is credited at first as far as the run's rounds are.
    planner = RoundPlanner(ForwardCostModel())
    offer = Offer(FreeDrafter({}, 0), 64, weights="bf16", num_cached=800)
    planner.run_acceptance[offer.acceptance_key] = record
    state = FakeState(LosslessConfig(create_compressor("snapkv", compression_ratio=0.9), "auto"), [offer.drafter], {})
    assert planner.acceptance_of(state, offer).credited() == record.credited()  # type: ignore[arg-type]


@dataclasses.dataclass(slots=True)
class DraftCosts(ScriptedCosts):
    """Scripted costs where a forward on draft weights (not the served ones) costs its own price."""

    def share_s(self, weights: str, segment: SegmentShape, num_sharing: float) -> float:
        self.calls += 1
        if weights != "same":
            return self.cheap_draft_s if self.calls > self.dear_calls else self.draft_s
        if segment.num_tokens == 0:
            return 0.0  # a forward's fixed part alone: these scripted costs have none
        return self.step_s + self.verify_token_s * (segment.num_tokens - 1)


def _run(prompts: list[list[int]], config: GenerationConfig, lossless: LosslessConfig,
         costs: ForwardCostModel) -> tuple[Engine, list[int]]:
    engine = Engine(tiny_llama(num_kv_heads=2))
    engine.planner.costs = costs
    ids = [engine.add_request(Request(prompt, config, lossless=lossless)) for prompt in prompts]
    while engine.has_work():
        engine.step()
    return engine, ids


class ScriptedDrafter(Drafter):
    """Proposes the tokens of `script` that follow the context (a token never emitted past its end), priced
    as draft forwards on bf16 weights though none runs: drafts always right, or always wrong."""

    name = "scripted"  # type: ignore[assignment]

    def __init__(self, script: dict[int, list[int]], wrong_token: int) -> None:
        self.script, self.wrong_token = script, wrong_token

    def offer(self, host: RoundHost, state: LosslessState, limit: int) -> Offer | None:
        return Offer(self, limit, weights="bf16", num_cached=0) if limit else None

    def draft(self, host: RoundHost, state: LosslessState, offer: Offer,
              num_tokens: int) -> Generator[Feed, torch.Tensor, Proposal]:
        yield from ()
        context = host.context_ids()
        for prompt_length, continuation in self.script.items():
            if context[:prompt_length] == self.prompts[prompt_length]:
                done = len(context) - prompt_length
                ahead = continuation[done : done + num_tokens]
                return Proposal(ahead + [self.wrong_token] * (num_tokens - len(ahead)))
        return Proposal([self.wrong_token] * num_tokens)

    prompts: dict[int, list[int]] = {}


def _scripted(prompts: list[list[int]], config: GenerationConfig, right: bool) -> ScriptedDrafter:
    expected = reference_generate(tiny_llama(num_kv_heads=2), prompts, config)
    emitted = {token for request in expected.requests for token in request.token_ids}
    wrong = min(set(range(3, 96)) - emitted)
    drafter = ScriptedDrafter({len(p): r.token_ids for p, r in zip(prompts, expected.requests, strict=True)}
                              if right else {}, wrong)
    drafter.prompts = {len(prompt): prompt for prompt in prompts}
    return drafter


def _run_scripted(batch: int, right: bool, draft_s: float, monkeypatch: pytest.MonkeyPatch
                  ) -> tuple[Engine, list[int], list[list[int]]]:
    """`batch` sequences drafting from a `ScriptedDrafter` (always right or always wrong) at `draft_s` per
    draft; returns the engine, the request ids and the reference decoder's tokens."""
    prompts = [_prompts(60 + row)[0] for row in range(batch)]
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    drafter = _scripted(prompts, config, right=right)
    monkeypatch.setattr(round_module, "drafters_of", lambda settings: [drafter])
    lossless = LosslessConfig(create_compressor("streamingllm", budget=4), "auto")
    engine, ids = _run(prompts, config, lossless, DraftCosts(draft_s=draft_s, cheap_draft_s=draft_s, step_s=0.05))
    expected = reference_generate(engine.loaded, prompts, config)
    return engine, ids, [request.token_ids for request in expected.requests]


@pytest.mark.parametrize("batch", [1, 8])
def test_the_planner_takes_plain_steps_when_drafts_are_never_accepted(
    batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, ids, expected = _run_scripted(batch, False, 0.03, monkeypatch)
    rounds = 0
    for index, request_id in enumerate(ids):
        assert engine.output(request_id).token_ids == expected[index]
        stats = engine.round_stats(request_id)
        assert stats is not None
        rounds += stats.rounds
        # A few short probes at most: the evidence that drafting does not pay holds it off.
        assert stats.num_plain_rounds >= 0.75 * stats.rounds, stats.num_draft_tokens_per_round
    assert engine.planner.num_plans["plain"] >= 0.75 * rounds


@pytest.mark.parametrize("batch", [1, 8])
def test_the_planner_drafts_long_when_drafts_are_always_accepted_and_cheap(
    batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, ids, expected = _run_scripted(batch, True, 0.005, monkeypatch)
    for index, request_id in enumerate(ids):
        assert engine.output(request_id).token_ids == expected[index]
        stats = engine.round_stats(request_id)
        assert stats is not None and stats.num_plain_rounds <= 1  # only a last round with one token left
        # Every draft accepted: the rounds grow (the first is short: the drafter's prior is only a prior).
        assert stats.acceptance_length > 5 and max(stats.num_draft_tokens_per_round) >= 8, \
            stats.num_draft_tokens_per_round


def test_sequences_planning_together_draft_and_verify_in_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four sequences whose drafts are accepted unevenly (the model on their own compressed caches) take one
    length together each time they plan together: no tick drafts for some while it verifies others, so the
    group's draft forwards and verifies stay shared. Every output is the plain output."""
    prompts = [_prompts(48 + 5 * row)[0] for row in range(4)]
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    lossless = LosslessConfig(create_compressor("streamingllm", budget=8), "auto", draft_weights="bf16")
    engine = Engine(tiny_llama(num_kv_heads=2))
    engine.planner.costs = DraftCosts(draft_s=0.002, cheap_draft_s=0.002, step_s=0.05)
    ticks: list[list[tuple[bool, int]]] = []  # per tick, per forward: (on the served weights, its longest segment)
    original_tick, original_run = engine_tick.Decoder.tick, engine_runner.run_packed

    def recording_tick(decoder: engine_tick.Decoder, *args: object) -> object:
        ticks.append([])
        return original_tick(decoder, *args)  # type: ignore[arg-type]

    def recording_run(model: object, segments: list[Segment], token_ids: list[list[int]],
                      logits_at: list[int]) -> torch.Tensor:
        ticks[-1].append((model is engine.loaded.model, max(segment.num_tokens for segment in segments)))
        return original_run(model, segments, token_ids, logits_at)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_tick.Decoder, "tick", recording_tick)
    monkeypatch.setattr(engine_runner, "run_packed", recording_run)
    ids = [engine.add_request(Request(prompt, config, lossless=lossless)) for prompt in prompts]
    while engine.has_work():
        engine.step()
    expected = reference_generate(engine.loaded, prompts, config)
    for request_id, reference in zip(ids, expected.requests, strict=True):
        assert engine.output(request_id).token_ids == reference.token_ids
    drafted = [tick for tick in ticks if any(not served for served, _ in tick)]
    assert len(drafted) > 5, "the scripted costs should make drafting pay"
    lengths = [stats.num_draft_tokens_per_round for stats in map(engine.round_stats, ids) if stats is not None]
    assert len({tuple(rounds[:3]) for rounds in lengths}) == 1, lengths  # the first rounds: one length for all
    # Only where a sequence's remaining tokens cap its round (its last ones) does it verify before the others.
    mixed = [tick for tick in drafted if any(served and longest > 1 for served, longest in tick)]
    assert len(mixed) <= len(prompts), f"ticks that drafted for some sequences while verifying others: {mixed}"


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_every_decision_keeps_the_plain_output_for_every_drafter(name: str) -> None:
    """Drafting dear then cheap, with prompt lookup composed: the planner goes through plain steps, lookup
    rounds and compressed-cache rounds, sequences of different lengths joining and leaving mid-round."""
    prompts = [repetitive_prompt(70), _prompts(50)[0], _prompts(64)[0]]
    configs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (60, 23, 41)]
    lossless = LosslessConfig(create_compressor(name, **DRAFTERS[name]), "auto",  # type: ignore[arg-type]
                              draft_weights="bf16", prompt_lookup=PromptLookup())
    engine = Engine(tiny_llama(num_kv_heads=2))
    engine.planner.costs = DraftCosts(draft_s=0.2, cheap_draft_s=0.001, dear_calls=300, step_s=0.05)
    ids = []
    for index, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):
        ids.append(engine.add_request(Request(prompt, config, lossless=lossless)))
        for _ in range(3 * index):  # the later ones join while the first ones are mid-round
            engine.step()
    while engine.has_work():
        engine.step()
    for request_id, prompt, config in zip(ids, prompts, configs, strict=True):
        expected = reference_generate(engine.loaded, [prompt], config).requests[0].token_ids
        assert engine.output(request_id).token_ids == expected, f"{name} request {request_id}"
    plans = engine.planner.num_plans
    assert plans["plain"] > 0 and plans["compressed_cache"] > 0 and plans["prompt_lookup"] > 0, plans


def test_a_fixed_draft_length_is_kept_however_dear_drafting_is() -> None:
    prompt = _prompts(60)[0]
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    lossless = LosslessConfig(create_compressor("streamingllm", budget=4), 3)
    engine, ids = _run([prompt], config, lossless, DraftCosts(draft_s=1.0, cheap_draft_s=1.0))
    stats = engine.round_stats(ids[0])
    assert stats is not None
    assert set(stats.num_draft_tokens_per_round[:-1]) <= {3} and 3 in stats.num_draft_tokens_per_round


def test_the_engine_reports_the_cost_models_fit() -> None:
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    lossless = LosslessConfig(create_compressor("snapkv", **DRAFTERS["snapkv"]), "auto",  # type: ignore[arg-type]
                              draft_weights="bf16")
    engine = Engine(tiny_llama(num_kv_heads=2))
    engine.add_request(Request(_prompts(60)[0], config, lossless=lossless))
    while engine.has_work():
        engine.step()
    _, stats = engine.finish_stats()
    assert stats.cost_model_ticks > 0 and stats.cost_model_mre is not None
    assert set(stats.cost_model_coefficients) == {"same", "bf16"}
    assert sum(stats.num_plans.values()) == stats.rounds
    loaded = engine.loaded
    assert engine.planner.costs.kernel_queries == newest_kernel_queries(loaded.architecture.num_kv_groups,
                                                                        loaded.device, loaded.dtype)


def test_a_plain_only_engine_fits_nothing_and_counts_no_lossless_time() -> None:
    engine = Engine(tiny_llama(num_kv_heads=2))
    engine.add_request(Request(_prompts(40)[0], GenerationConfig(max_new_tokens=12, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    _, stats = engine.finish_stats()
    assert (stats.verify_s, stats.draft_s, stats.cost_model_ticks) == (0.0, 0.0, 0)
    assert not engine.planner.costs.fits and not engine.planner.num_plans


@dataclasses.dataclass
class FakeState:
    """A sequence as the planner reads it: a full cache of `num_cached` tokens, `tier_bytes` of it over a link."""

    settings: LosslessConfig
    drafters: list[Drafter]
    acceptance: dict[str, Acceptance]
    num_cached: int = 8000
    tier_bytes: int = 0
    draft: object = None
    full: object = None
    pending: list[int] = dataclasses.field(default_factory=lambda: [1])
    draft_missing: int = 1
    draft_logits: torch.Tensor | None = None
    in_transit: bool = False

    def full_shape(self, num_tokens: int) -> SegmentShape:
        return SegmentShape(num_tokens, self.num_cached, self.tier_bytes)


class FreeDrafter(ScriptedDrafter):
    def offer(self, host: RoundHost, state: LosslessState, limit: int) -> Offer | None:
        return Offer(self, limit, weights="bf16", num_cached=800)


class Host:
    def remaining(self) -> int:
        return 200


def test_a_slow_full_kv_link_makes_drafting_pay_and_rounds_long() -> None:
    """Behind a 2 GB/s link a plain step waits for the whole full KV; a staggered round hides its drafting
    behind that wait, so the planner drafts, and longer than in memory."""
    costs = ForwardCostModel(warm_up=0)
    for tokens, keys, seconds in ((1, 8000, 0.040), (9, 8000, 0.060), (17, 8000, 0.080), (1, 800, 0.021)):
        costs.observe_tick([("same", [SegmentShape(tokens, keys)], seconds)])
    for _ in range(3):
        costs.observe_tick([("bf16", [SegmentShape(1, 800)], 0.010)])
    drafter = FreeDrafter({}, 0)
    settings = LosslessConfig(create_compressor("snapkv", compression_ratio=0.9), "auto")
    lengths = {}
    for tier_bytes in (0, 370_000_000):
        costs.link_bytes_per_s = 2e9
        acceptance = Acceptance(0.5)
        for _ in range(20):
            acceptance.update(8, 4)  # about 0.8 per draft
        state = FakeState(settings, [drafter], {"scripted": acceptance}, tier_bytes=tier_bytes)
        plan = RoundPlanner(costs).plan(Host(), state)  # type: ignore[arg-type]
        lengths[tier_bytes] = plan.num_draft_tokens
        if tier_bytes:
            assert plan.plain_s > 0.18 and plan.offer is not None, plan
    assert lengths[370_000_000] > lengths[0], lengths


def test_a_batch_calibration_fits_the_batch_and_leaves_every_cache_as_it_was() -> None:
    from kvlab.generation.prefill import PrefillCaches, prefill
    from kvlab.lossless.calibration import calibrate_batch

    loaded = tiny_llama(num_kv_heads=2)
    pairs = []
    for prompt in (_prompts(40)[0], _prompts(52)[0]):
        full, draft, _ = prefill(loaded, [prompt], PrefillCaches(80, drafter=create_compressor("streamingllm",
                                                                                              budget=12)))
        assert draft is not None
        pairs.append((full, draft))
    pairs[1][1].set_provisional(True)  # a draft cache mid-round
    before = [(full.clone(), draft.clone()) for full, draft in pairs]
    costs = ForwardCostModel(warm_up=0)
    calibrate_batch(costs, {"same": loaded.model}, pairs, 5)
    assert costs.ready("same") and costs.fits["same"].num_observed == 2
    for (full, draft), (old_full, old_draft) in zip(pairs, before, strict=True):
        for cache, old in ((full, old_full), (draft, old_draft)):
            assert cache.seq_lengths == old.seq_lengths
            for layer, old_layer in zip(cache.layers, old.layers, strict=True):
                assert layer.lengths == old_layer.lengths  # type: ignore[attr-defined]
                length = layer.lengths[0]  # type: ignore[attr-defined]
                assert torch.equal(layer.keys[:, :, :length], old_layer.keys[:, :, :length])  # type: ignore[attr-defined]
    assert [draft.layers[0].deferred for _, draft in pairs] == [False, True]


@pytest.mark.parametrize("fixed", [1, 9, 32])
def test_a_fixed_length_past_the_search_window_is_still_chosen(fixed: int) -> None:
    from kvlab.lossless.planner import choose_length

    choice = choose_length(Acceptance(0.5), [fixed], lambda length: 0.01 * (length + 1), 0.01, 1.0)
    assert choice.num_draft_tokens == fixed


class KindDrafter(Drafter):
    """Offers proposals known in advance (no forward), of the kind the test sets."""

    name = "kinds"  # type: ignore[assignment]
    kind = "1-gram"

    def offer(self, host: RoundHost, state: LosslessState, limit: int) -> Offer | None:
        return Offer(self, min(limit, 8), token_ids=[7] * min(limit, 8), kind=self.kind)

    def draft(self, host: RoundHost, state: LosslessState, offer: Offer,
              num_tokens: int) -> Generator[Feed, torch.Tensor, Proposal]:
        yield from ()
        return Proposal([7] * num_tokens)


def test_offers_of_different_kinds_are_judged_by_their_own_acceptance() -> None:
    """A drafter whose short matches are always rejected and whose long ones always accepted: once both
    are known, the planner drafts long from a long match and takes a plain step on a short one (one
    record for both would judge each by the other's rounds)."""
    drafter = KindDrafter()
    settings = LosslessConfig(create_compressor("snapkv", compression_ratio=0.9), "auto")
    state = FakeState(settings, [drafter], {})
    planner = RoundPlanner(ScriptedCosts(step_s=0.05, verify_token_s=0.01))
    for _ in range(12):
        for kind, right in (("1-gram", False), ("8-gram", True)):
            drafter.kind = kind
            plan = planner.plan(Host(), state)  # type: ignore[arg-type]
            if plan.offer is not None:
                planner.round_done(state, plan, plan.num_draft_tokens, plan.num_draft_tokens if right else 0)
    assert set(state.acceptance) == {"kinds/1-gram", "kinds/8-gram"}
    drafter.kind = "1-gram"
    assert planner.plan(Host(), state).offer is None  # type: ignore[arg-type]
    drafter.kind = "8-gram"
    long = planner.plan(Host(), state)  # type: ignore[arg-type]
    assert long.offer is not None and long.num_draft_tokens == 8, long


class NoMatchLookup(KindDrafter):
    """A forward-free drafter that proposes at most 4 tokens a round and has no match now."""

    @property
    def round_tokens(self) -> int:
        return 4

    def offer(self, host: RoundHost, state: LosslessState, limit: int) -> Offer | None:
        return None


def test_beside_a_lookup_auto_rounds_draft_from_the_cache_no_longer_than_a_lookup_round() -> None:
    """Cache drafts always accepted and cheap: alone they draft long; beside a lookup of 4 tokens a round (no
    match this round) at most 4, since once the output copies its context the lookup proposes it free; a fixed
    length is kept."""
    costs = DraftCosts(step_s=0.05, verify_token_s=0.001, draft_s=0.002, cheap_draft_s=0.002)
    acceptance = Acceptance(0.5)
    for _ in range(30):
        acceptance.update(32, 32)
    lengths = {}
    for name, drafters, length in (("alone", [FreeDrafter({}, 0)], "auto"),
                                   ("beside", [NoMatchLookup(), FreeDrafter({}, 0)], "auto"),
                                   ("fixed", [NoMatchLookup(), FreeDrafter({}, 0)], 16)):
        settings = LosslessConfig(create_compressor("snapkv", compression_ratio=0.9), length)  # type: ignore[arg-type]
        state = FakeState(settings, drafters, {"scripted": dataclasses.replace(acceptance)})
        plan = RoundPlanner(costs).plan(Host(), state)  # type: ignore[arg-type]
        assert plan.offer is not None and plan.offer.drafter is drafters[-1], (name, plan)
        lengths[name] = plan.num_draft_tokens
    assert lengths["alone"] > 4 and lengths["beside"] == 4 and lengths["fixed"] == 16, lengths


class ShortHost(Host):
    """A sequence with `left` tokens still to generate."""

    def __init__(self, left: int) -> None:
        self.left = left

    def remaining(self) -> int:
        return self.left


def test_a_group_members_round_stays_within_what_it_may_still_generate() -> None:
    """Sequences planning together are planned when the first of them plans, before the others have emitted
    their last round: a member whose budget shrank since drafts no more than it may still emit (else the
    round's accepted drafts would be counted and never emitted), and none where one token is left."""
    planner = RoundPlanner(DraftCosts(draft_s=0.002, cheap_draft_s=0.002, step_s=0.05))
    settings = LosslessConfig(create_compressor("snapkv", compression_ratio=0.9), "auto")
    states = [FakeState(settings, [FreeDrafter({}, 0)], {}) for _ in range(3)]
    hosts = [ShortHost(200), ShortHost(200), ShortHost(200)]
    planner.start_group(list(zip(hosts, states, strict=True)))  # type: ignore[arg-type]
    first = planner.plan(hosts[0], states[0])  # type: ignore[arg-type]
    assert first.offer is not None and first.num_draft_tokens > 3, first
    hosts[1].left, hosts[2].left = 4, 1  # their last rounds emitted since
    second = planner.plan(hosts[1], states[1])  # type: ignore[arg-type]
    third = planner.plan(hosts[2], states[2])  # type: ignore[arg-type]
    assert second.num_draft_tokens == 3 and second.offer is not None, second
    assert third.num_draft_tokens == 0 and third.offer is None, third
