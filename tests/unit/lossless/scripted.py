"""A cost model that ignores measurements, for tests whose planner decisions must not follow the machine's speed."""

from __future__ import annotations

import dataclasses

from kvlab.lossless.cost_model import ForwardCostModel, SegmentShape


@dataclasses.dataclass(slots=True)
class ScriptedCosts(ForwardCostModel):
    """Costs that ignore measurements: draft forwards cost `draft_s` per segment share (after `dear_calls`
    calls, `cheap_draft_s`), a full-cache step `step_s` plus `verify_token_s` per extra token."""

    draft_s: float = 0.05
    cheap_draft_s: float = 0.05
    dear_calls: int = 0
    step_s: float = 0.05
    verify_token_s: float = 0.001
    calls: int = 0

    def ready(self, weights: str) -> bool:
        return True

    def share_s(self, weights: str, segment: SegmentShape, num_sharing: float) -> float:
        self.calls += 1
        if segment.num_cached < 0:
            raise AssertionError
        return self.step_s + self.verify_token_s * (segment.num_tokens - 1)

    def observe_tick(self, forwards: list[tuple[str, list[SegmentShape], float]], calibration: bool = False) -> None:
        return None
