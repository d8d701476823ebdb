"""The engine's run figures: tokens, timing, time to first token, cache sizes, lossless rounds, tiers' loads
and the cost model's fit. Returned as data (`Engine.finish_stats`), never printed."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlab.cache.tiers import TierLoader
from kvlab.engine.config import EngineCallbacks
from kvlab.engine.sequence import Sequence
from kvlab.generation.outputs import GenerationStats, finish_timing
from kvlab.lossless.planner import RoundPlanner
from kvlab.lossless.stats import LosslessStats
from kvlab.timing import Stopwatch


class RunFigures:
    """Every request's figures so far (or, in a long-lived engine, only what stays bounded).

    Args:
        device: Where the model runs (the run's clock synchronizes it).
        aggregate: Add every request's rounds and prefix fetches up (False in a long-lived engine,
            whose per-round lists would grow with every request it serves).
        callbacks: The engine's callbacks (progress and streamed tokens).
    """

    def __init__(self, device: torch.device | str, aggregate: bool, callbacks: EngineCallbacks) -> None:
        self.stats = GenerationStats()
        self.lossless_stats = LosslessStats()
        self.clock = Stopwatch(device)
        self.aggregate = aggregate
        self.callbacks = callbacks
        self.num_added = 0
        self.num_admitted = 0
        self.num_emitting = 0

    def admitted(self, sequence: Sequence) -> None:
        self.num_admitted += 1
        self.stats.prompt_tokens += len(sequence.request.prompt)

    def on_emit(self, sequence: Sequence, token_ids: list[int]) -> None:
        """A sequence emitted `token_ids` (its first ones when they are all it has)."""
        if len(sequence.token_ids) == len(token_ids):
            self.num_emitting += 1
        self.stats.new_tokens += len(token_ids)
        everyone_started = self.num_emitting == self.num_admitted == self.num_added
        if not self.stats.ttft_s and everyone_started:
            self.stats.ttft_s = self.clock.elapsed()
        if self.callbacks.on_progress is not None:
            self.callbacks.on_progress(len(token_ids))
        if self.callbacks.on_tokens is not None and token_ids:
            self.callbacks.on_tokens(sequence.id, token_ids)

    def record_caches(self, sequences: list[Sequence]) -> None:
        caches = [sequence.stored_cache for sequence in sequences if sequence.stored_cache is not None]
        if caches:
            self.stats.record_caches(caches)  # type: ignore[arg-type]

    def records(self) -> GenerationStats | None:
        """Where per-request records (prefix fetches) go: the run's figures, or nowhere."""
        return self.stats if self.aggregate else None

    def totals(self) -> LosslessStats:
        """Where a sequence's rounds add up: the run's figures, or a record that goes with the sequence."""
        return self.lossless_stats if self.aggregate else LosslessStats()

    def forward(self, seconds: float, verifying: bool) -> None:
        """A forward that carried lossless feeds took `seconds` (verifying, or only drafting)."""
        if verifying:
            self.lossless_stats.verify_s += seconds
        else:
            self.lossless_stats.draft_s += seconds

    def finish(self, loaders: list[TierLoader], planner: RoundPlanner,
               elapsed: Callable[[], float] | None = None) -> tuple[GenerationStats, LosslessStats]:
        """The figures with the tiers' loads, the cost model's fit and the timing completed."""
        self.stats.tier_bytes_read = sum(loader.stats.bytes_read for loader in loaders)
        self.stats.tier_wait_s = sum(loader.stats.wait_s for loader in loaders)
        self.lossless_stats.kv_load_s += self.stats.tier_wait_s
        fit = planner.costs.fit
        self.lossless_stats.cost_model_ticks = fit.num_ticks
        self.lossless_stats.cost_model_mre = fit.mean_relative_error if fit.num_ticks else None
        self.lossless_stats.cost_model_coefficients = planner.costs.coefficients()
        self.lossless_stats.num_plans = dict(planner.num_plans)
        finish_timing(self.stats, (elapsed or self.clock.elapsed)(), self.num_admitted)
        return self.stats, self.lossless_stats
