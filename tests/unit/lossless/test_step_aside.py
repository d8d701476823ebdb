"""Stepping aside: under `auto` a sequence drafts nothing while drafting is not expected to pay, probes
again from time to time and returns to drafting when it pays; its output stays the plain output."""

from __future__ import annotations

import dataclasses

import pytest

from kvlab.compress import create_compressor
from kvlab.engine import Engine, EngineConfig, Request
from kvlab.generation import GenerationConfig, reference_generate
from kvlab.lossless import LosslessConfig
from kvlab.lossless.draft_length import DraftLengthController, StepCosts
from kvlab.lossless.gate import GateConfig
from tests.helpers import tiny_llama
from tests.unit.lossless.test_lossless import DRAFTERS, _prompts

UNGATED = EngineConfig(drafting_gate=GateConfig(enabled=False))


def test_costs_tell_plain_steps_from_verifies() -> None:
    costs = StepCosts()
    costs.observe(0.02, num_draft_segments=2, full_segment_tokens=[])  # 10 ms per draft segment
    costs.observe(0.06, num_draft_segments=0, full_segment_tokens=[1, 1])  # 30 ms per plain step
    costs.observe(0.13, num_draft_segments=1, full_segment_tokens=[1, 9])  # 90 ms for the verify
    assert (costs.draft_s, costs.plain_s, costs.verify_s) == pytest.approx((0.01, 0.03, 0.09))
    assert StepCosts(verify_s=0.5).plain_step_s == 0.5  # no plain step seen yet: a verify's cost


def test_a_sequence_stands_aside_probes_and_returns_when_acceptance_recovers() -> None:
    costs = StepCosts(draft_s=0.02, verify_s=0.06, plain_s=0.05)
    controller = DraftLengthController(costs, initial_num_draft_tokens=4, probe_num_draft_tokens=2,
                                       min_probe_interval=3, max_probe_interval=6)
    for _ in range(4):
        controller.update(4, 0)  # nothing accepted: a round costs more than the one token it emits
    lengths = [controller.next_num_draft_tokens() for _ in range(4)]
    assert lengths == [0, 0, 0, 2] and controller.num_stood_aside == 3  # a short probe after three rounds aside
    controller.update(2, 0)  # the probe did not pay: the next one comes after twice as many rounds
    assert [controller.next_num_draft_tokens() for _ in range(7)] == [0] * 6 + [2]
    for _ in range(4):
        controller.update(4, 4)  # acceptance recovers
    assert controller.next_num_draft_tokens() > 0 and controller.probe_interval == 0


def test_no_probe_is_drafted_where_no_acceptance_could_pay() -> None:
    # A draft forward costs a plain step (a short prompt: the weights dominate): even 8 drafts all
    # accepted would emit 9 tokens in 9.1 plain steps' time, so the sequence never probes.
    costs = StepCosts(draft_s=0.05, verify_s=0.055, plain_s=0.05)
    controller = DraftLengthController(costs, min_probe_interval=2, max_probe_interval=4)
    for _ in range(4):
        controller.update(8, 0)
    assert [controller.next_num_draft_tokens() for _ in range(20)] == [0] * 20
    assert controller.num_stood_aside == 20
    costs.draft_s = 0.01  # drafting got cheap (a longer context): probes come back
    assert 2 in [controller.next_num_draft_tokens() for _ in range(8)]


def test_a_new_sequence_drafts_first_only_where_drafting_could_pay() -> None:
    unmeasured = DraftLengthController(StepCosts(), initial_num_draft_tokens=8)
    assert unmeasured.next_num_draft_tokens() == 8  # its first round measures the costs
    dear = DraftLengthController(StepCosts(draft_s=0.05, verify_s=0.055, plain_s=0.05), initial_num_draft_tokens=8)
    assert dear.next_num_draft_tokens() == 0 and dear.num_stood_aside == 1
    cheap = DraftLengthController(StepCosts(draft_s=0.01, verify_s=0.06, plain_s=0.05), initial_num_draft_tokens=8)
    assert cheap.next_num_draft_tokens() == 8


def test_an_untimed_plain_step_is_timed_once_where_drafting_only_beats_a_verifys_cost_narrowly() -> None:
    # A verify of 2 tokens costs 80 ms and stands in for the plain step until one is timed; a round
    # drafting 1 token (60 ms) that is almost always accepted would emit ~1.9 tokens per 140 ms: 1.09x
    # the verify's rate, 0.98x the true plain rate of 72 ms. One plain round times it.
    costs = StepCosts(draft_s=0.06, verify_s=0.08, max_segments=1)
    controller = DraftLengthController(costs, max_num_draft_tokens=1)
    for _ in range(6):
        controller.update(1, 1)
    assert controller.next_num_draft_tokens() == 0 and controller.num_stood_aside == 1
    costs.observe(0.072, num_draft_segments=0, full_segment_tokens=[1])
    assert costs.plain_s == pytest.approx(0.072)
    assert controller.next_num_draft_tokens() == 0  # timed: drafting does not pay, it stands aside
    untimed_costs = StepCosts(draft_s=0.06, verify_s=0.08, max_segments=1)
    untimed = DraftLengthController(untimed_costs, max_num_draft_tokens=1)
    for _ in range(6):
        untimed.update(1, 1)
    # Where no forward times a plain step (packed beside verifies), it asks once and then drafts.
    assert [untimed.next_num_draft_tokens() for _ in range(3)] == [0, 1, 1]
    clear = DraftLengthController(StepCosts(draft_s=0.01, verify_s=0.08), max_num_draft_tokens=8)
    for _ in range(6):
        clear.update(8, 8)
    assert clear.next_num_draft_tokens() == 8  # far ahead of any plain cost: no plain round to time it
    batched_costs = StepCosts(draft_s=0.06, verify_s=0.08, max_segments=4)
    batched = DraftLengthController(batched_costs, max_num_draft_tokens=1)
    for _ in range(6):
        batched.update(1, 1)
    assert batched.next_num_draft_tokens() == 1  # packed beside others, a plain segment's share is not its cost


def test_fixed_draft_lengths_never_stand_aside() -> None:
    controller = DraftLengthController(StepCosts(draft_s=1.0, verify_s=1.0, plain_s=0.01), fixed=3)
    for _ in range(5):
        controller.update(3, 0)
    assert controller.next_num_draft_tokens() == 3


@dataclasses.dataclass(slots=True)
class ScriptedCosts(StepCosts):
    """Costs that ignore measurements: drafting is dear for the first `dear_rounds` reads, then cheap."""

    dear_rounds: int = 0
    reads: int = 0

    def observe(self, seconds: float, num_draft_segments: int, full_segment_tokens: list[int]) -> None:
        self.reads += 1
        cheap = self.reads > self.dear_rounds
        self.draft_s, self.verify_s, self.plain_s = (0.001, 0.01, 0.01) if cheap else (0.05, 0.06, 0.01)


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_standing_aside_keeps_the_plain_output_for_every_drafter(name: str) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompt = _prompts(70)[0]
    config = GenerationConfig(max_new_tokens=60, ignore_eos=True)
    expected = reference_generate(loaded, [prompt], config).requests[0].token_ids
    settings = LosslessConfig(create_compressor(name, **DRAFTERS[name]), "auto")  # type: ignore[arg-type]
    always = LosslessConfig(settings.drafter, 4)
    for lossless, dear_rounds in ((settings, 40), (always, 40)):
        engine = Engine(loaded, UNGATED)  # the sequence's own choice, not the run's timed verdict
        engine.costs = ScriptedCosts(dear_rounds=dear_rounds)
        request_id = engine.add_request(Request(prompt, config, lossless=lossless))
        while engine.has_work():
            engine.step()
        assert engine.output(request_id).token_ids == expected, f"{name} {lossless.num_draft_tokens}"
        stats = engine.round_stats(request_id)
        assert stats is not None
        if lossless.num_draft_tokens == "auto":
            # It stood aside while drafting was dear, then drafted again once it was cheap.
            rounds = stats.num_draft_tokens_per_round
            assert stats.num_plain_rounds > 1 and stats.num_drafting_rounds > 1, (name, rounds)
            assert rounds[-3:-1] != [0, 0], (name, rounds)
        else:
            assert stats.num_plain_rounds <= 1  # only a round with one token left drafts nothing
