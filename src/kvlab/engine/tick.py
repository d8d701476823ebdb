"""One decoding tick: every running sequence's next feed, packed into one forward per set of weights.

Forwards on a drafter's own weights (bf16, int8, int4) run first, then the served weights' forward
with every verify, plain step and same-weight draft. Each forward's seconds, less what it waited for
a slower tier, go to the planner's cost model with the shapes of its segments; a failing forward
fails the sequences it carried, and a failure in one sequence's own work fails that sequence alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlab.attention_kernels import newest_kernel_queries
from kvlab.cache import KVCache
from kvlab.cache.tiers import TierLoader, TierSpec
from kvlab.engine.figures import RunFigures
from kvlab.engine.runner import group_by_model, pack, run_batch
from kvlab.engine.sequence import Sequence, Status
from kvlab.lossless.calibration import CalibrationStore, calibrate, calibrate_batch
from kvlab.lossless.cost_model import ForwardCostModel, SegmentShape
from kvlab.lossless.planner import RoundPlanner

Fail = Callable[[Sequence, BaseException], None]


class Decoder:
    """Runs ticks over the running sequences.

    Args:
        target: The served weights.
        weight_sets: Every set of weights by name ("same" is `target`; a drafter's copies by their name).
        planner: The rounds' planner (its cost model observes each forward; its batch view is updated).
        figures: The run's figures.
        loaders: The tiers' loaders (their waits are taken out of the forwards' seconds; their link's rate
            is the cost model's).
        calibrations: Where the cost model's calibration is kept between runs on this machine.
        num_kv_groups: Query heads per KV head of the served model (what the C++ attention kernel takes
            depends on it: `kvlab.attention_kernels.newest_kernel_queries`).
    """

    def __init__(self, target: torch.nn.Module, weight_sets: dict[str, torch.nn.Module], planner: RoundPlanner,
                 figures: RunFigures, loaders: dict[TierSpec, TierLoader], calibrations: CalibrationStore,
                 num_kv_groups: int) -> None:
        self.target = target
        self.weight_sets = weight_sets
        self.planner = planner
        self.figures = figures
        self.loaders = loaders
        self.calibrations = calibrations
        self._restored = False
        self.num_kv_groups = num_kv_groups
        self._kernel_queries: int | None = None

    def tier_wait_s(self) -> float:
        """Seconds forwards have waited for slower tiers so far (all tiers together)."""
        return sum(loader.stats.wait_s for loader in self.loaders.values())

    def link_bytes_per_s(self) -> float | None:
        """The slowest tier link's rate (None in memory)."""
        rates = [rate for loader in self.loaders.values() if (rate := loader.bytes_per_s()) is not None]
        return min(rates) if rates else None

    def tick(self, running: list[Sequence], fail: Fail) -> tuple[list[Sequence], bool]:
        """One tick over `running`; returns the sequences whose rounds ended (they stopped), and whether a
        lossless sequence verified (its draft cache then grew by the exact KV the verify handed it)."""
        # What rounds planned in this tick see: this batch and the tier's link.
        self.planner.batch.num_running = len(running)
        self.planner.costs.link_bytes_per_s = self.link_bytes_per_s()
        self._price_kernel()
        self._calibrate_batch(running)
        # Sequences starting their rounds now plan them together (`RoundPlanner.start_group`), and so do
        # those whose verifies or plain steps this tick runs, as their logits come back.
        self.planner.start_group([(sequence, sequence.lossless) for sequence in running
                                  if sequence.lossless is not None and not sequence.primed])
        for sequence in running:
            try:
                sequence.prime()
            except Exception as error:  # one request's failure is that request's alone
                fail(sequence, error)
        running = [sequence for sequence in running if sequence.status is Status.RUNNING]
        owners = {id(sequence.feed): sequence for sequence in running}
        feeds = [(self._model_for(sequence), sequence.feed) for sequence in running if sequence.feed is not None]
        lossless = any(sequence.lossless is not None for sequence in running)
        observed: list[tuple[str, list[SegmentShape], float]] = []
        verified = False
        self.planner.start_group([(sequence, sequence.lossless) for sequence in running if sequence.lossless
                                  is not None and sequence.feed is not None and not sequence.feed.drafting])
        for model, group in group_by_model(feeds, self.target):  # type: ignore[arg-type]
            batch = pack(model, group)
            waited = self.tier_wait_s()
            try:
                logits, seconds = run_batch(batch, model.device)  # type: ignore[arg-type]
            except Exception as error:  # the forward's sequences fail, the others go on
                for feed in batch.feeds:
                    fail(owners[id(feed)], error)
                continue
            if lossless:
                observed.append((self._weights_of(model), batch.shapes,
                                 max(seconds - (self.tier_wait_s() - waited), 0.0)))
                self.figures.forward(seconds, verifying=len(batch.feeds) > batch.num_drafting)
            for feed, feed_logits in zip(batch.feeds, logits, strict=True):
                sequence = owners[id(feed)]
                verified |= sequence.lossless is not None and not feed.drafting
                try:
                    sequence.advance(feed_logits)
                except Exception as error:  # one request's failure is that request's alone
                    fail(sequence, error)
        if observed:
            self.planner.costs.observe_tick(observed)
        stopped = [sequence for sequence in running if sequence.status is Status.RUNNING and sequence.feed is None]
        return stopped, verified

    def calibrate(self, weights: str, full: KVCache, draft: KVCache, token_id: int) -> None:
        """Fit the cost model to the served weights and `weights` (in `weight_sets`): from the calibration an
        earlier run on this machine kept, and by `calibrate`'s forwards on a new lossless sequence's caches
        where no calibration covers their lengths yet (the new ones are kept)."""
        costs = self._price_kernel()
        if not self._restored:
            self._restored = True
            self.calibrations.restore(costs)
        if calibrate(costs, {"same": self.target, weights: self.weight_sets[weights]}, full, draft, token_id):
            self.calibrations.save(costs)

    def _price_kernel(self) -> ForwardCostModel:
        """The cost model, told which segments the C++ attention kernel takes (found once: the kernel is built
        then, as the first decode step would build it)."""
        if self._kernel_queries is None:
            weight = next(self.target.parameters())
            self._kernel_queries = newest_kernel_queries(self.num_kv_groups, weight.device, weight.dtype)
        self.planner.costs.kernel_queries = self._kernel_queries
        return self.planner.costs

    def _calibrate_batch(self, running: list[Sequence]) -> None:
        """Calibrate the cost model on this batch of lossless sequences when it is the largest yet, here or
        in the kept calibration (`calibrate_batch`: its forwards are rolled back, mid-round caches included)."""
        states = [sequence.lossless for sequence in running if sequence.lossless is not None]
        costs = self.planner.costs
        if len(states) <= costs.calibrated_batch:
            return
        pairs = [(state.full, state.draft) for state in states if isinstance(state.full, KVCache)]
        weights = {state.settings.draft_weights for state in states}
        models = {"same": self.target} | {name: self.weight_sets[name] for name in weights}
        calibrate_batch(costs, models, pairs, states[0].pending[-1] if states[0].pending else 0)
        costs.calibrated_batch = len(states)
        self.calibrations.save(costs)

    def _model_for(self, sequence: Sequence) -> torch.nn.Module:
        feed, lossless = sequence.feed, sequence.request.lossless
        if feed is not None and feed.drafting and lossless is not None:
            return self.weight_sets[lossless.draft_weights]
        return self.target

    def _weights_of(self, model: torch.nn.Module) -> str:
        return next((name for name, weights in self.weight_sets.items() if weights is model), "same")
