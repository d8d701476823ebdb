"""The drafting gate: drafting windows timed against plain windows decide, for the whole run, whether
lossless sequences under `auto` may draft; a closed gate makes every round a plain step, so the output
stays the plain output."""

from __future__ import annotations

import pytest

from kvlab.compress import create_compressor
from kvlab.engine import Engine, EngineConfig, Request
from kvlab.generation import GenerationConfig, reference_generate
from kvlab.lossless import LosslessConfig
from kvlab.lossless.draft_length import DraftLengthController, StepCosts
from kvlab.lossless.gate import DraftingGate, GateConfig, GatePhase, Window
from tests.helpers import tiny_llama
from tests.unit.lossless.test_lossless import DRAFTERS, _prompts
from tests.unit.lossless.test_step_aside import ScriptedCosts

PACE = GateConfig(plain_ticks=2, trial_ticks=4, min_interval=8, max_interval=16)


def drive(gate: DraftingGate, num_ticks: int, drafting_tokens_per_tick: float) -> str:
    """Run `num_ticks` ticks of one sequence, 0.1 s each: a plain step emits one token; while the gate is
    open a tick drafts and emits `drafting_tokens_per_tick` on average; the tick after the gate stops
    drafting still finishes a round (not plain-only). Returns each tick's phase as it began, as letters
    (p, d, r): the plain tick that ends a drain begins in `r` and is the first of the closed stretch."""
    letters, drafting_credit, in_flight = [], 0.0, False
    for _ in range(num_ticks):
        letters.append({GatePhase.PLAIN: "p", GatePhase.DRAFTING: "d", GatePhase.DRAINING: "r"}[gate.phase])
        if gate.allows_drafting() or in_flight:
            in_flight = gate.allows_drafting()
            drafting_credit += drafting_tokens_per_tick
            tokens, drafting_credit = int(drafting_credit), drafting_credit - int(drafting_credit)
            gate.observe_tick(0.1, tokens, 1, plain_only=False)
        else:
            gate.observe_tick(0.1, 1, 1, plain_only=True)
    return "".join(letters)


def test_drafting_that_loses_is_closed_and_retried_after_a_doubling_interval() -> None:
    gate = DraftingGate(PACE)
    phases = drive(gate, 60, drafting_tokens_per_tick=0.5)
    # An untimed first tick and plain timing, a trial of 4 ticks and a tick to drain; closed 8, a trial;
    # closed 16 (the most), ...
    closed_8, closed_16 = "r" + "p" * 7, "r" + "p" * 15
    assert phases.startswith("ppp" + "dddd" + "r" + closed_8 + "dddd" + "r" + closed_16 + "dddd" + "r" + closed_16)
    assert gate.verdicts[:3] == [False, False, False]
    assert gate.plain_rate == pytest.approx(10.0) and gate.drafting_rate == pytest.approx(4.0)
    assert gate.num_closed_ticks == phases.count("p") + phases.count("r")


def test_drafting_that_pays_narrowly_stays_open_and_plain_steps_are_timed_again_between_intervals() -> None:
    gate = DraftingGate(PACE)
    phases = drive(gate, 60, drafting_tokens_per_tick=1.25)  # 1.25x plain: past min_gain, short of wide_gain
    # After each window: a drain, plain timing (2 ticks), then open for 8, then 16 (the most).
    timing = "r" + "rp"
    assert phases.startswith("ppp" + "dddd" + timing + "d" * 8 + timing + "d" * 16 + timing + "d" * 16)
    assert gate.verdicts[:3] == [True, True, True]


def test_drafting_that_pays_widely_stays_open_without_timing_plain_steps_again() -> None:
    # A slow full-KV tier: a plain tick reads every row's full KV over the link, so drafting wins widely
    # and the gate should not spend plain ticks checking it.
    gate = DraftingGate(PACE)
    phases = drive(gate, 60, drafting_tokens_per_tick=3.0)
    assert phases == "ppp" + "d" * 57
    assert gate.verdicts[:3] == [True, True, True] and gate.num_closed_ticks == 3


def test_a_verdict_that_flips_restarts_the_interval() -> None:
    gate = DraftingGate(PACE)
    drive(gate, 30, drafting_tokens_per_tick=0.5)  # closed twice: the interval grew to 16
    assert gate.verdicts == [False, False]
    phases = drive(gate, 40, drafting_tokens_per_tick=1.25)
    assert gate.verdicts[2] is True
    assert "rp" + "d" * 8 + "r" in phases  # open for the shortest interval again


def test_a_drafting_window_waits_for_a_plain_tick_at_most_max_drain_ticks() -> None:
    # A sequence with a fixed draft length ignores the gate and never takes a plain step.
    gate = DraftingGate(GateConfig(plain_ticks=1, trial_ticks=2, min_interval=4, max_interval=4, max_drain_ticks=3))
    gate.observe_tick(0.2, 1, 1, plain_only=True)  # the run's first tick: untimed
    gate.observe_tick(0.1, 1, 1, plain_only=True)
    phases = []
    for _ in range(12):
        phases.append(gate.phase)
        gate.observe_tick(0.1, 0, 1, plain_only=False)  # nothing emitted: drafting loses
    drafting, draining, plain = GatePhase.DRAFTING, GatePhase.DRAINING, GatePhase.PLAIN
    # Three ticks drained; the fourth judges (it began draining) and is the first of four closed ones.
    assert phases == [drafting] * 2 + [draining] * 4 + [plain] * 3 + [drafting] * 2 + [draining]
    assert gate.verdicts == [False]


def test_a_disabled_gate_is_always_open() -> None:
    gate = DraftingGate(GateConfig(enabled=False))
    for _ in range(30):
        assert gate.allows_drafting()
        gate.observe_tick(0.1, 0, 1, plain_only=False)
    assert gate.verdicts == [] and gate.num_closed_ticks == 0


def test_window_rates_are_per_running_sequence() -> None:
    window = Window()
    window.add(0.1, 4, 4)  # four sequences, one token each in 0.1 s: 10 tokens/s each
    window.add(0.1, 8, 8)
    assert window.rate == pytest.approx(10.0)
    assert Window().rate == 0.0


def test_gate_config_refuses_meaningless_pacing() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        GateConfig(trial_ticks=0)
    with pytest.raises(ValueError, match="max_interval"):
        GateConfig(min_interval=8, max_interval=4)
    with pytest.raises(ValueError, match="min_gain"):
        GateConfig(min_gain=0)
    with pytest.raises(ValueError, match="wide_gain"):
        GateConfig(min_gain=1.2, wide_gain=1.1)


def test_a_closed_gate_makes_auto_rounds_plain_but_not_fixed_ones() -> None:
    gate = DraftingGate(PACE)  # closed: it times plain steps first
    costs = StepCosts(draft_s=0.001, verify_s=0.01, plain_s=0.05)
    auto = DraftLengthController(costs, gate=gate)
    fixed = DraftLengthController(costs, fixed=3, gate=gate)
    assert (auto.next_num_draft_tokens(), auto.drafting_allowed()) == (0, False)
    assert auto.num_stood_aside == 0  # the run's verdict, not this sequence's choice
    assert (fixed.next_num_draft_tokens(), fixed.drafting_allowed()) == (3, True)
    drive(gate, 3, drafting_tokens_per_tick=1.0)  # the untimed first tick and two timed plain ones
    assert gate.allows_drafting() and auto.next_num_draft_tokens() == auto.initial_num_draft_tokens


@pytest.mark.parametrize("name", sorted(DRAFTERS))
@pytest.mark.parametrize("min_gain", [1e-9, 1e9], ids=["open", "closed"])
def test_a_gate_switching_mid_round_keeps_the_plain_output_for_every_drafter(name: str, min_gain: float) -> None:
    # Shortest pacing: the gate opens and closes every few ticks, while rounds of three ragged sequences are
    # in flight; with min_gain tiny every verdict opens drafting (narrowly: plain steps are timed again
    # after every window, so rounds drain), with min_gain huge every verdict closes it.
    loaded = tiny_llama(num_kv_heads=2)
    prompts = _prompts(70, 55, 40)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    expected = [request.token_ids for request in reference_generate(loaded, prompts, config).requests]
    pace = GateConfig(plain_ticks=1, trial_ticks=2, min_interval=2, max_interval=4, min_gain=min_gain, wide_gain=1e9)
    engine = Engine(loaded, EngineConfig(drafting_gate=pace))
    engine.costs = ScriptedCosts()  # drafting cheap: each sequence drafts whenever the gate lets it
    settings = LosslessConfig(create_compressor(name, **DRAFTERS[name]), "auto")  # type: ignore[arg-type]
    ids = [engine.add_request(Request(prompt, config, lossless=settings)) for prompt in prompts]
    while engine.has_work():
        engine.step()
    assert [engine.output(request_id).token_ids for request_id in ids] == expected, name
    stats = engine.lossless_stats
    assert stats.num_plain_rounds > 0 and stats.num_drafting_rounds > 0, stats.num_draft_tokens_per_round
    assert len(engine.gate.verdicts) >= 3 and set(engine.gate.verdicts) == {min_gain < 1}


def test_ticks_are_timed_only_where_the_gate_is_enabled_and_a_lossless_sequence_runs() -> None:
    assert DraftingGate().start_tick(0, [], "cpu", lossless=False) is None
    assert DraftingGate(GateConfig(enabled=False)).start_tick(0, [], "cpu", lossless=True) is None
    tick = DraftingGate().start_tick(5, [], "cpu", lossless=True)
    assert tick is not None and tick.tokens_before == 5 and tick.plain_only
