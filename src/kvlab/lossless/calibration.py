"""A short calibration of the cost model on a new lossless sequence's own caches, rolled back after.

The planner costs a round before it runs it, so its first round needs a fitted model. A few forwards
cover the shapes a round runs: plain steps and verifies of 8 and 16 drafts on the served weights,
and draft steps on the weights that draft. Each feeds copies of one token and is rolled back at once
(`drop_last`, the same rollback as a rejected draft's), so the caches hold exactly what they held.
A full KV on a slower tier is not read (every read would cost the link): the served weights are then
calibrated on the draft cache, which is in fast memory.
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
            seconds, shape = _timed_forward(model, cache, token_id, num_tokens)
            costs.observe_tick([(weights, [shape], seconds)], compare=False)


def _timed_forward(
    model: torch.nn.Module, cache: KVCache, token_id: int, num_tokens: int
) -> tuple[float, SegmentShape]:
    shape = SegmentShape(num_tokens, cache.layers[0].lengths[0])  # type: ignore[attr-defined]
    cache.set_provisional(True)  # a compressed layer never compresses what is rolled back
    try:
        clock = Stopwatch(model.device)  # type: ignore[arg-type]
        with torch.inference_mode():
            run_packed(model, [Segment(cache, num_tokens)], [[token_id] * num_tokens], [num_tokens - 1])  # type: ignore[arg-type]
        seconds = clock.elapsed()
        cache.drop_last(num_tokens)
    finally:
        cache.set_provisional(False)
    return seconds, shape
