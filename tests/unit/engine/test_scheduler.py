"""The scheduler's order: interleaved prefill goes round-robin among the prefilling sequences, so a short
prompt beside a long one starts decoding after a few of the long one's pieces, not after all of them."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Status


@dataclasses.dataclass(eq=False)
class FakeSequence:
    """What the scheduler reads of a sequence: whether it is ready, and its status; `pieces` is what is
    left of its prompt."""

    name: str
    pieces: int
    ready: bool = True
    status: Status = Status.WAITING


def run_ticks(scheduler: Scheduler, num_ticks: int, arrivals: dict[int, list[FakeSequence]] | None = None) -> list[str]:
    """As `Engine.step` does: admit, prefill one piece of each sequence `to_prefill` returns (a finished
    prompt starts running); returns the name of the sequence each piece went to, in order."""
    order: list[str] = []
    for tick in range(num_ticks):
        for sequence in (arrivals or {}).get(tick, []):
            scheduler.add(sequence)  # type: ignore[arg-type]
        scheduler.admit()
        for sequence in scheduler.to_prefill():
            fake: Any = sequence
            order.append(fake.name)
            fake.pieces -= 1
            if fake.pieces == 0:
                scheduler.start_running(sequence)
    return order


def test_prefill_pieces_go_round_robin_among_the_prefilling_sequences() -> None:
    scheduler = Scheduler(max_num_seqs=None, interleave_prefill=True)
    long, short, medium = FakeSequence("long", 6), FakeSequence("short", 1), FakeSequence("medium", 2)
    for sequence in (long, short, medium):
        scheduler.add(sequence)  # type: ignore[arg-type]
    order = run_ticks(scheduler, 9)
    assert order == ["long", "short", "medium", "long", "medium", "long", "long", "long", "long"], order
    assert [s.status for s in (long, short, medium)] == [Status.PREFILLING] * 3, "statuses are the engine's to move"
    assert scheduler.running == [short, medium, long], "prompts must start running as their last piece is done"


def test_a_short_prompt_arriving_beside_a_long_one_waits_for_one_of_its_pieces_not_all() -> None:
    scheduler = Scheduler(max_num_seqs=8, interleave_prefill=True)
    long, short = FakeSequence("long", 12), FakeSequence("short", 1)
    order = run_ticks(scheduler, 13, arrivals={0: [long], 3: [short]})
    assert order.index("short") == 4, f"the short prompt waited behind {order.index('short') - 3} pieces: {order}"
    assert order.count("long") == 12 and scheduler.running == [short, long]


def test_a_newcomer_joins_the_back_of_the_line() -> None:
    scheduler = Scheduler(max_num_seqs=None, interleave_prefill=True)
    a, b, c = FakeSequence("a", 3), FakeSequence("b", 3), FakeSequence("c", 3)
    order = run_ticks(scheduler, 9, arrivals={0: [a, b], 1: [c]})
    # c arrives after a's first piece: the line is then b, a, c.
    assert order == ["a", "b", "a", "c", "b", "a", "c", "b", "c"], order


def test_without_interleaving_every_admitted_prompt_prefills_whole() -> None:
    scheduler = Scheduler(max_num_seqs=2, interleave_prefill=False)
    first, second, third = FakeSequence("1", 1), FakeSequence("2", 1), FakeSequence("3", 1)
    for sequence in (first, second, third):
        scheduler.add(sequence)  # type: ignore[arg-type]
    scheduler.admit()
    assert scheduler.to_prefill() == [first, second], "max_num_seqs bounds the prompts admitted"
    assert scheduler.to_prefill() == [first, second], "offline prefill must not rotate"


def test_a_sequence_still_fetching_waits_without_holding_up_the_others() -> None:
    scheduler = Scheduler(max_num_seqs=None, interleave_prefill=True)
    fetching, ready = FakeSequence("fetching", 1, ready=False), FakeSequence("ready", 1)
    for sequence in (fetching, ready):
        scheduler.add(sequence)  # type: ignore[arg-type]
    assert run_ticks(scheduler, 2) == ["ready"]
    fetching.ready = True
    assert run_ticks(scheduler, 1) == ["fetching"]
