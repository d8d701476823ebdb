"""Whether drafting pays for the whole run, measured: drafting windows against plain windows.

Each sequence's `DraftLengthController` models its own rounds from per-segment costs. In a packed
batch those costs do not add up: the forward reads the weights once, whatever its segments, so a
sequence drafting beside others pays less than its share suggests, and a verify beside plain steps
more. At 2K context and batch 4 the model drafted where plain steps were 1.3x faster. The gate does
not model: it times the engine's ticks. It sets windows in which lossless sequences may draft against
windows of plain steps only, compares the tokens per second each gave per running sequence, and
closes drafting while plain steps are faster, for an interval that doubles while the verdict holds.
Closed, every lossless round is a plain step, exactly as when a controller stands aside, so the
output is unchanged; only the speed depends on the gate.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from kvlab.generation.feed import Feed
from kvlab.timing import Stopwatch


@dataclasses.dataclass(frozen=True, slots=True)
class GateConfig:
    """How the run-level check of drafting is paced, in engine ticks (one packed forward each).

    Attributes:
        enabled: Check at all (False: drafting is always open, as before the gate).
        plain_ticks: Plain-only ticks that time plain decoding before each verdict.
        trial_ticks: Ticks drafting is open on trial after a closed interval.
        min_interval, max_interval: Ticks a verdict holds before it is checked again; it doubles from
            the first to the second while the verdict stays the same.
        min_gain: Drafting stays open while its rate is at least this multiple of plain steps' rate (a
            little over 1: where the two are level, plain steps are the safe choice).
        wide_gain: A drafting window this much faster than plain steps keeps drafting open for the next
            interval without timing plain steps again.
        max_drain_ticks: The most ticks a drafting window waits for a plain-only tick to close it (a
            sequence with a fixed draft length, which ignores the gate, never takes one).
    """

    enabled: bool = True
    plain_ticks: int = 2
    trial_ticks: int = 16
    min_interval: int = 48
    max_interval: int = 768
    min_gain: float = 1.05
    wide_gain: float = 1.5
    max_drain_ticks: int = 80

    def __post_init__(self) -> None:
        if min(self.plain_ticks, self.trial_ticks, self.min_interval, self.max_drain_ticks) < 1:
            raise ValueError("plain_ticks, trial_ticks, min_interval and max_drain_ticks must be at least 1")
        if self.max_interval < self.min_interval:
            raise ValueError(f"max_interval ({self.max_interval}) must be at least min_interval ({self.min_interval})")
        if self.min_gain <= 0 or self.wide_gain < self.min_gain:
            raise ValueError(f"need 0 < min_gain <= wide_gain, got {self.min_gain} and {self.wide_gain}")


MAX_VERDICTS_KEPT = 256


class GatePhase(enum.Enum):
    PLAIN = "plain"  # drafting closed; plain-only ticks are timed
    DRAFTING = "drafting"  # drafting open; every tick is timed
    DRAINING = "draining"  # no new drafting rounds; in-flight rounds finish, still timed as drafting


@dataclasses.dataclass(slots=True)
class Window:
    """Tokens, seconds and sequence-ticks of a run of ticks."""

    tokens: int = 0
    seconds: float = 0.0
    sequence_ticks: int = 0
    ticks: int = 0

    def add(self, seconds: float, num_tokens: int, num_sequences: int) -> None:
        self.tokens += num_tokens
        self.seconds += seconds
        self.sequence_ticks += num_sequences
        self.ticks += 1

    @property
    def rate(self) -> float:
        """Tokens per second per running sequence (batches of different sizes stay comparable)."""
        if not self.ticks or self.seconds <= 0:
            return 0.0
        return self.tokens / self.seconds / (self.sequence_ticks / self.ticks)


@dataclasses.dataclass(slots=True)
class TickRecord:
    """One engine tick as the gate sees it: tokens emitted before it, its clock, its feeds, and whether
    every feed was a plain step (one token on a full cache, no drafting)."""

    tokens_before: int
    clock: Stopwatch
    num_feeds: int
    plain_only: bool

    @classmethod
    def start(cls, tokens_before: int, feeds: list[Feed], device: torch.device | str) -> TickRecord:
        plain_only = all(not feed.drafting and len(feed.token_ids) == 1 for feed in feeds)
        return cls(tokens_before, Stopwatch(device), len(feeds), plain_only)


@dataclasses.dataclass(slots=True)
class DraftingGate:
    """The run's verdict on drafting, from timed windows (see the module docstring).

    Phases: it starts closed (`PLAIN`): an untimed first tick, then `plain_ticks` timed plain ticks;
    it opens (`DRAFTING`) for `trial_ticks`. At the end of a drafting window the verdict compares its
    rate with the plain window's. A window that wins even counting no token of the rounds still in
    flight pays: drafting stays open for the next interval, at once where it wins by `wide_gain`, else
    after draining the rounds in flight (`DRAINING`: no new drafting rounds until a tick is
    plain-only) and `plain_ticks` to time plain steps anew. A window that does not win is drained
    first, so its rate counts whole rounds; if it still loses, drafting is closed for an interval, then
    gets another trial.

    Attributes:
        config: The pacing.
        phase: Where it stands.
        num_closed_ticks: Ticks drafting was closed (plain timing included).
        verdicts: The verdicts in order (the last MAX_VERDICTS_KEPT), True where drafting paid.
        plain_rate, drafting_rate: The last windows' rates (tokens/s per running sequence).
    """

    config: GateConfig = dataclasses.field(default_factory=GateConfig)
    phase: GatePhase = GatePhase.PLAIN
    num_closed_ticks: int = 0
    verdicts: list[bool] = dataclasses.field(default_factory=list)
    plain_rate: float = 0.0
    drafting_rate: float = 0.0
    _ticks_left: int = 0
    _interval: int = 0
    _judge_after_drain: bool = True
    _warm: bool = False
    _plain: Window = dataclasses.field(default_factory=Window)
    _drafting: Window = dataclasses.field(default_factory=Window)

    def __post_init__(self) -> None:
        self._ticks_left = self.config.plain_ticks

    def allows_drafting(self) -> bool:
        """Whether a lossless round starting now may draft."""
        return not self.config.enabled or self.phase is GatePhase.DRAFTING

    def start_tick(
        self, tokens_before: int, feeds: list[Feed], device: torch.device | str, lossless: bool
    ) -> TickRecord | None:
        """A record of the tick about to run, or None where there is nothing to time: the gate is disabled
        or no lossless sequence runs (a plain-only engine pays no clock and no device synchronization)."""
        if not self.config.enabled or not lossless:
            return None
        return TickRecord.start(tokens_before, feeds, device)

    def observe(self, tick: TickRecord, tokens_after: int) -> None:
        """Fold in a tick the engine ran with lossless sequences, once it is over."""
        self.observe_tick(tick.clock.elapsed(), tokens_after - tick.tokens_before, tick.num_feeds, tick.plain_only)

    def observe_tick(self, seconds: float, num_tokens: int, num_sequences: int, plain_only: bool) -> None:
        """Fold in one engine tick that ran lossless sequences: its seconds, the tokens it emitted, the
        sequences it ran, and whether every one of them took a plain step."""
        if not self.config.enabled:
            return
        if not self._warm:
            # The run's first tick is slower than the next (first appends and kernel set-ups: 73-79 ms
            # against 70-71 at batch 4, 2K), which near break-even would tip verdicts to drafting.
            self._warm = True
            self.num_closed_ticks += 1
            return
        if self.phase is GatePhase.DRAINING and (plain_only or -self._ticks_left >= self.config.max_drain_ticks):
            if self._judge_after_drain:
                self._judge(self._drafting.rate)
            self._close(self.config.plain_ticks if self.verdicts[-1] else self._interval)
        if self.phase is GatePhase.PLAIN:
            # Sequences with a fixed draft length ignore the gate: their ticks count down, untimed.
            self.num_closed_ticks += 1
            if plain_only:
                self._plain.add(seconds, num_tokens, num_sequences)
            self._ticks_left -= 1
            if self._ticks_left <= 0:
                self._open(self._interval if self.verdicts and self.verdicts[-1] else self.config.trial_ticks)
            return
        self._drafting.add(seconds, num_tokens, num_sequences)
        self._ticks_left -= 1
        if self.phase is GatePhase.DRAINING:
            self.num_closed_ticks += 1
        elif self._ticks_left <= 0:
            self._end_drafting_window()

    def _end_drafting_window(self) -> None:
        """Judge now where the window already wins, else drain it first. Its rate is a lower bound (the
        rounds in flight have cost time but not yet emitted), so a win needs no drain; a wide win keeps
        drafting open without timing plain steps again, which is what a slow full-KV tier needs: there a
        plain tick reads every row's full KV over the link."""
        rate, plain_rate = self._drafting.rate, self._plain_reference()
        if rate < self.config.min_gain * plain_rate:
            self.phase, self._judge_after_drain = GatePhase.DRAINING, True  # whole rounds before closing
            return
        self._judge(rate)
        if rate >= self.config.wide_gain * plain_rate:
            self._open(self._interval)
        else:
            self.phase, self._judge_after_drain = GatePhase.DRAINING, False  # a narrow lead: time plain anew

    def _plain_reference(self) -> float:
        """The plain window's rate, or the last one timed where this window had no plain-only tick."""
        return self._plain.rate if self._plain.ticks else self.plain_rate

    def _open(self, ticks: int) -> None:
        self.phase, self._ticks_left = GatePhase.DRAFTING, ticks
        self._drafting = Window()

    def _close(self, ticks: int) -> None:
        self.phase, self._ticks_left = GatePhase.PLAIN, ticks
        self._plain = Window()

    def _judge(self, drafting_rate: float) -> None:
        """A verdict from the drafting window's rate against the plain window's; sets the next interval."""
        self.drafting_rate, self.plain_rate = drafting_rate, self._plain_reference()
        pays = drafting_rate >= self.config.min_gain * self.plain_rate
        same = bool(self.verdicts) and self.verdicts[-1] == pays
        self._interval = min(2 * self._interval, self.config.max_interval) if same else self.config.min_interval
        self.verdicts.append(pays)
        del self.verdicts[:-MAX_VERDICTS_KEPT]  # a long-lived engine keeps only the recent ones
