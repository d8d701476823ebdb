"""The tokens requests hold: prompt + max_tokens, summed over the requests in the system, which bounds KV memory.

Two bounds keep one client from locking the others out. A request may hold at most its share
(`ServeConfig.tokens_per_request`: by default `max_tokens_in_system / max_num_seqs`, so that many
requests always fit at once); more is refused with 400, however idle the server. And a request whose
tokens do not fit right now waits for them rather than being refused: waiters are served first come,
first served (a small request never overtakes a large one that waits before it, so none starves),
and only a request that finds `max_queued_requests` already waiting is refused with 429.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import threading
from collections.abc import Awaitable, Callable

from kvlab.errors import ConfigError
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import ServerBusyError
from kvlab.serve.metrics import ServeMetrics


class _State(enum.Enum):
    WAITING = "waiting"
    HELD = "held"
    RELEASED = "released"


class TokenHold:
    """One request's tokens: held, or its place in the line for them.

    Attributes:
        num_tokens: Prompt + max_tokens of every prompt of the request.
        granted: Done once the tokens are held (at once when they fitted); never done when the hold is
            released while it waits.
    """

    def __init__(self, budget: TokenBudget, num_tokens: int, granted: asyncio.Future[None]) -> None:
        self.num_tokens, self.granted = num_tokens, granted
        self._budget = budget
        self._state = _State.WAITING

    def release(self) -> None:
        """Give the tokens back, or leave the line; once, however often it is called, from any thread."""
        self._budget._release(self)

    async def wait(self, gone: Callable[[], Awaitable[bool]], poll_s: float) -> bool:
        """Wait, without holding the event loop, until the tokens are held: True then; False once `gone()`
        (asked every `poll_s` seconds: the client went away), and the hold is released. A cancelled
        wait releases it too."""
        try:
            while not self.granted.done():
                await asyncio.wait({self.granted}, timeout=poll_s)
                if not self.granted.done() and await gone():
                    self.release()
                    return False
        except BaseException:
            self.release()
            raise
        return True


class TokenBudget:
    """Tokens of the requests in the system (see the module docstring). Thread-safe: requests end on the
    engine's thread; a waiter's `granted` future is resolved on its own event loop.

    Args:
        limit: Tokens held at once (`max_tokens_in_system`).
        per_request: Tokens one request may hold (`ServeConfig.tokens_per_request`).
        max_waiting: Requests that may wait for tokens (`max_queued_requests`).
        metrics: Its gauges: `num_tokens_in_system`, and the waiters in `num_requests_waiting`.
    """

    def __init__(self, limit: int, per_request: int, max_waiting: int, metrics: ServeMetrics) -> None:
        if not 1 <= per_request <= limit:  # a waiter that could never fit would hold up everyone behind it
            raise ValueError(f"per_request must be in 1..{limit} (the limit), got {per_request}")
        self.limit, self.per_request, self.max_waiting = limit, per_request, max_waiting
        self.metrics = metrics
        self.num_tokens = 0
        self._waiting: collections.deque[TokenHold] = collections.deque()
        self._lock = threading.Lock()

    @classmethod
    def for_server(cls, config: ServeConfig, metrics: ServeMetrics) -> TokenBudget:
        """The budget `config` sets: `max_tokens_in_system`, `tokens_per_request` and `max_queued_requests`."""
        return cls(config.max_tokens_in_system, config.tokens_per_request, config.max_queued_requests, metrics)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their tokens."""
        with self._lock:
            return len(self._waiting)

    def hold(self, num_tokens: int) -> TokenHold:
        """Hold `num_tokens` now, or line up for them; call it on the event loop that awaits
        `TokenHold.granted`, and release the hold once the request has ended (or gave up waiting).

        Raises:
            ConfigError: `num_tokens` passes the share of one request (HTTP 400).
            ServerBusyError: They do not fit now and `max_waiting` requests already wait (HTTP 429).
        """
        if num_tokens > self.per_request:
            raise ConfigError(
                f"the prompts and max_tokens of this request come to {num_tokens} tokens; one request may hold at "
                f"most {self.per_request} of the {self.limit} this server holds at once (max_tokens_per_request, "
                "--max-tokens-per-request): ask for fewer max_tokens or send fewer prompts"
            )
        hold = TokenHold(self, num_tokens, asyncio.get_running_loop().create_future())
        with self._lock:
            if not self._waiting and self.num_tokens + num_tokens <= self.limit:
                self._grant(hold)
            elif len(self._waiting) >= self.max_waiting:
                raise ServerBusyError(
                    f"the server holds {self.num_tokens} of its {self.limit} tokens (max_tokens_in_system) and "
                    f"{len(self._waiting)} requests already wait for tokens (max_queued_requests); this request "
                    f"needs {num_tokens} (prompt + max_tokens): retry later or ask for fewer max_tokens"
                )
            else:
                self._waiting.append(hold)
            self._update_gauges()
        return hold

    def _release(self, hold: TokenHold) -> None:
        with self._lock:
            if hold._state is _State.RELEASED:
                return
            if hold._state is _State.HELD:
                self.num_tokens -= hold.num_tokens
            else:
                self._waiting.remove(hold)
            hold._state = _State.RELEASED
            # In arrival order: the first waiter that does not fit stops the others behind it.
            while self._waiting and self.num_tokens + self._waiting[0].num_tokens <= self.limit:
                self._grant(self._waiting.popleft())
            self._update_gauges()

    def _grant(self, hold: TokenHold) -> None:
        """Count `hold`'s tokens as held and tell its waiter (under the lock)."""
        hold._state = _State.HELD
        self.num_tokens += hold.num_tokens
        with contextlib.suppress(RuntimeError):  # its loop is closed (the server stopped): nobody waits
            hold.granted.get_loop().call_soon_threadsafe(_resolve, hold.granted)

    def _update_gauges(self) -> None:
        self.metrics.tokens_in_system.set(self.num_tokens)
        self.metrics.set_waiting(tokens=len(self._waiting))


def _resolve(granted: asyncio.Future[None]) -> None:
    if not granted.done():  # cancelled: its waiter gave up, and releasing its hold gives the tokens back
        granted.set_result(None)
