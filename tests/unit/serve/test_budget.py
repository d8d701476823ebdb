"""The token budget of the server: one request's share (400 past it), waiting in arrival order for
tokens rather than a 429 while the line has room, and no token lost whichever way a request leaves."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from kvlab.errors import ConfigError
from kvlab.serve.budget import TokenBudget, TokenHold
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import ServerBusyError
from kvlab.serve.metrics import ServeMetrics

T = TypeVar("T")
POLL_S = 0.01


def run(test: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(test(), timeout=30))  # type: ignore[arg-type]


def make_budget(limit: int = 100, per_request: int = 100, max_waiting: int = 4) -> TokenBudget:
    return TokenBudget(limit, per_request, max_waiting, ServeMetrics("m"))


def gauges(budget: TokenBudget) -> tuple[float | None, float | None]:
    """(num_tokens_in_system, num_requests_waiting)."""
    registry = budget.metrics.registry
    return (registry.get_sample_value("kvlab:num_tokens_in_system", {"model_name": "m"}),
            registry.get_sample_value("kvlab:num_requests_waiting", {"model_name": "m"}))


async def never_gone() -> bool:
    return False


async def settle() -> None:
    """Let callbacks scheduled on the loop (grants) run."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_the_default_share_leaves_room_for_max_num_seqs_requests() -> None:
    assert ServeConfig(max_tokens_in_system=1000, max_num_seqs=8).tokens_per_request == 125
    assert ServeConfig(max_tokens_in_system=1000, max_tokens_per_request=600).tokens_per_request == 600
    with pytest.raises(ConfigError, match="max_tokens_per_request must be in 1..1000"):
        ServeConfig(max_tokens_in_system=1000, max_tokens_per_request=1001)


def test_a_request_over_its_share_is_refused_naming_the_limit_and_the_flag() -> None:
    async def test() -> None:
        budget = make_budget(limit=1000, per_request=125)
        with pytest.raises(ConfigError, match=r"126 tokens.*at most 125 of the 1000.*--max-tokens-per-request"):
            budget.hold(126)
        assert budget.num_tokens == 0 and budget.num_waiting == 0, "a refused request must hold nothing"
        budget.hold(125).release()

    run(test)


def test_tokens_that_do_not_fit_wait_in_arrival_order_and_nobody_overtakes() -> None:
    async def test() -> None:
        budget = make_budget(limit=100)
        first = budget.hold(70)
        await settle()
        assert first.granted.done()
        large, small = budget.hold(60), budget.hold(20)  # the small one would fit now: it must not overtake
        await settle()
        assert not large.granted.done() and not small.granted.done(), "a later, smaller request overtook"
        assert gauges(budget) == (70, 2)
        first.release()
        await settle()
        assert large.granted.done() and small.granted.done(), "released tokens did not go to the waiters"
        assert budget.num_tokens == 80 and gauges(budget) == (80, 0)

    run(test)


def test_a_429_only_once_the_line_for_tokens_is_full() -> None:
    async def test() -> None:
        budget = make_budget(limit=100, max_waiting=2)
        budget.hold(100)
        budget.hold(10), budget.hold(10)
        with pytest.raises(ServerBusyError, match="2 requests already wait for tokens"):
            budget.hold(10)
        assert budget.num_waiting == 2 and budget.num_tokens == 100

    run(test)


def test_no_queue_means_a_429_at_once() -> None:
    async def test() -> None:
        budget = make_budget(limit=100, max_waiting=0)
        budget.hold(90)
        with pytest.raises(ServerBusyError, match="max_queued_requests"):
            budget.hold(20)
        budget.hold(10)  # what fits is held at once

    run(test)


def test_a_waiter_whose_client_goes_away_leaves_the_line_and_unblocks_those_behind() -> None:
    async def test() -> None:
        budget = make_budget(limit=100)
        first = budget.hold(50)
        blocked, behind = budget.hold(80), budget.hold(40)
        gone = asyncio.Event()

        async def client_gone() -> bool:
            return gone.is_set()

        waiting = asyncio.create_task(blocked.wait(client_gone, POLL_S))
        await asyncio.sleep(5 * POLL_S)
        assert not waiting.done()
        gone.set()
        assert await waiting is False, "a waiter whose client went away must stop waiting"
        await settle()
        assert behind.granted.done(), "the request behind one that left was not served"
        assert budget.num_tokens == 90 and budget.num_waiting == 0
        first.release(), behind.release()
        assert gauges(budget) == (0, 0)

    run(test)


def test_a_cancelled_wait_gives_its_tokens_back_even_once_granted() -> None:
    async def test() -> None:
        budget = make_budget(limit=100)
        first = budget.hold(100)
        still_waiting, granted_late = budget.hold(30), budget.hold(30)
        tasks = [asyncio.create_task(hold.wait(never_gone, 10.0)) for hold in (still_waiting, granted_late)]
        await settle()
        tasks[0].cancel()
        first.release()  # the second is granted; it is cancelled before it runs again
        tasks[1].cancel()
        for task in tasks:
            with pytest.raises(asyncio.CancelledError):
                await task
        assert budget.num_tokens == 0 and budget.num_waiting == 0, "a cancelled wait kept tokens or its place"

    run(test)


def test_release_from_another_thread_wakes_the_waiter_and_counts_once() -> None:
    async def test() -> None:
        budget = make_budget(limit=100)
        running = budget.hold(100)
        waiter = budget.hold(60)
        engine_thread = threading.Thread(target=lambda: [running.release() for _ in range(3)])
        engine_thread.start()
        assert await waiter.wait(never_gone, 10.0) is True
        engine_thread.join()
        assert budget.num_tokens == 60, "a release counted more than once, or the waiter was not granted"
        waiter.release(), waiter.release()
        assert gauges(budget) == (0, 0)

    run(test)


def test_a_hold_is_granted_at_once_when_it_fits_and_nobody_waits() -> None:
    async def test() -> TokenHold:
        budget = make_budget(limit=100)
        hold = budget.hold(100)
        assert await hold.wait(never_gone, 10.0) is True
        return hold

    assert run(test).num_tokens == 100
