"""A short calibration of the cost model on a new lossless sequence's own caches, rolled back after.

The planner costs a round before it runs it, so its first round needs a fitted model. A few forwards
cover the shapes a round runs: plain steps and verifies of 8 and 16 drafts on the served weights,
and draft steps on the weights that draft. Each feeds copies of one token and is rolled back at once
(`drop_last`, the same rollback as a rejected draft's), so the caches hold exactly what they held.
A full KV on a slower tier is not read (every read would cost the link): the served weights are then
calibrated on the draft cache, which is in fast memory.

A batch is calibrated too, once per new largest batch (`calibrate_batch`): one packed plain step over
every running sequence's full cache and one packed draft step over their draft caches. Without it the
model would learn a large batch's costs only from the ticks the planner chose, and a batch that drafts
never shows what its plain ticks cost (at 8K and batch 8, a plain tick costs about half of what single
sequences' costs add up to).
"""

from __future__ import annotations

import torch

from kvlab.cache import KVCache, Segment, run_packed
from kvlab.cache.tiers import TieredKVLayer
from kvlab.lossless.cost_model import ForwardCostModel, SegmentShape
from kvlab.timing import Stopwatch

# Tokens per calibration forward on the served weights (a plain step twice: its first pays set-ups).
SERVED_TOKENS = (1, 1, 9, 17)
DRAFT_STEPS = 3


def calibrate(
    costs: ForwardCostModel, models: dict[str, torch.nn.Module], full: KVCache, draft: KVCache, token_id: int
) -> None:
    """Fit `costs` for each weight set in `models` ("same" for the served weights) not fitted yet."""
    served = draft if isinstance(full.layers[0], TieredKVLayer) else full
    for weights, model in models.items():
        if costs.ready(weights):
            continue
        if weights == "same":
            runs = [(served, tokens) for tokens in SERVED_TOKENS] + [(draft, 1)] * DRAFT_STEPS
        else:
            runs = [(draft, 1)] * (DRAFT_STEPS + 1)
        for cache, num_tokens in runs:
            # The faster of two: a shared machine only ever adds time, and one slow calibration forward
            # would hold the planner to a wrong cost until enough forwards of that shape outweigh it.
            (seconds, shape), (again, _) = (_timed_forward(model, cache, token_id, num_tokens) for _ in range(2))
            costs.observe_tick([(weights, [shape], min(seconds, again))], compare=False)


def calibrate_batch(costs: ForwardCostModel, models: dict[str, torch.nn.Module], pairs: list[tuple[KVCache, KVCache]],
                    token_id: int) -> None:
    """One packed plain step over the full caches of `pairs` (those in fast memory) on the served weights, and
    one packed draft step over their draft caches on each weight set in `models`, rolled back after."""
    fulls = [full for full, _ in pairs if not isinstance(full.layers[0], TieredKVLayer)]
    drafts = [draft for _, draft in pairs]
    if len(fulls) > 1:
        seconds, shapes = _timed_packed(models["same"], fulls, token_id)
        costs.observe_tick([("same", shapes, seconds)], compare=False)
    for weights, model in models.items():
        seconds, shapes = _timed_packed(model, drafts, token_id)
        costs.observe_tick([(weights, shapes, seconds)], compare=False)


def _timed_forward(
    model: torch.nn.Module, cache: KVCache, token_id: int, num_tokens: int
) -> tuple[float, SegmentShape]:
    seconds, shapes = _timed_packed(model, [cache], token_id, num_tokens)
    return seconds, shapes[0]


def _timed_packed(
    model: torch.nn.Module, caches: list[KVCache], token_id: int, num_tokens: int = 1
) -> tuple[float, list[SegmentShape]]:
    """One packed forward feeding `num_tokens` copies of `token_id` to each cache, rolled back after."""
    shapes = [SegmentShape(num_tokens, cache.layers[0].lengths[0]) for cache in caches]  # type: ignore[attr-defined]
    provisional = [cache.layers[0].deferred for cache in caches]  # a draft cache mid-round stays provisional
    for cache in caches:
        cache.set_provisional(True)  # a compressed layer never compresses what is rolled back
    try:
        ends = [num_tokens * (index + 1) - 1 for index in range(len(caches))]
        clock = Stopwatch(model.device)  # type: ignore[arg-type]
        with torch.inference_mode():
            run_packed(model, [Segment(cache, num_tokens) for cache in caches],  # type: ignore[arg-type]
                       [[token_id] * num_tokens for _ in caches], ends)
        seconds = clock.elapsed()
        for cache in caches:
            cache.drop_last(num_tokens)
    finally:
        for cache, was_provisional in zip(caches, provisional, strict=True):
            cache.set_provisional(was_provisional)
    return seconds, shapes
