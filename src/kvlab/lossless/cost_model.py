"""What a packed forward costs on this machine: a linear model fitted to the forwards the engine runs.

A forward on one set of weights `w` packs segments i = 1..n; segment i feeds q_i tokens after the
T_i tokens its cache holds, so its attention reads T_i + q_i keys with q_i queries. Segments of at most
`kernel_queries` queries (K, where the C++ split-KV kernel takes them) and longer ones (P) read their keys
by different paths. A forward takes

    seconds = c0[w] + c1[w] * sum q_i + c2[w] * sum_{i in K} (T_i + q_i) / 1e3 + c3[w] * sum_{i in P} (T_i + q_i) / 1e3
              + c4[w] * sum_{i in K} (q_i - 1)(T_i + q_i) / 1e5
              + c5[w] * sum_{i in P, q_i <= 64} (q_i - 1)(T_i + q_i) / 1e5
              + c6[w] * sum_{q_i > 64} (q_i - 1)(T_i + q_i) / 1e5
              + the wait for any full KV held on a slower tier

- c0: reading the weights once (and the forward's fixed host work), shared by every segment;
- c1: the linear layers' work per token;
- c2: the split-KV kernel (`kvlab.attention_kernels.NEWEST_ATTENTION`) streaming a segment's keys and
  values, per thousand keys: plain and draft steps, and verifies short enough for it;
- c3: the same read by a segment of more queries (a longer verify), which takes other paths (scores written
  out as matrix products; over long caches, key pieces through the flash kernel): at 8K keys it reads them
  several times slower, so one coefficient for both would price a batch's plain steps at what its
  verifies pay (measured at 8K, batch 8: 31 ms predicted per plain row against 15 ms);
- c4: the kernel's work for a segment's queries past its first, per query and key (per hundred thousand):
  each more query row is more arithmetic over the same stream of keys;
- c5: the same in the matrix-product paths, up to 64 queries (`kvlab.attention.FOLDED_SCORES_MAX_QUERIES`);
- c6: the same in longer segments (a long prompt piece), which take the flash kernel.

`kernel_queries` is 1 where the kernel does not run (not float32 on the CPU, not built): then K holds the
one-query segments and c4 has nothing to price.

The tier's part is not fitted: a full KV on a slower tier moves over one link at a known rate (an
emulated link's rate is declared; another tier's is measured by its loader), so reading it costs its
bytes over that rate. Fitting uses each forward's seconds less the time it waited for the tier.

Each weight set's coefficients are a least-squares fit with exponential forgetting (`forgetting`
per forward, so the fit follows a machine whose speed drifts), regularised by a small ridge towards
zero so that collinear features (a batch of one-token steps) stay bounded, and kept non-negative. A
forward is predicted before it is folded in, so the reported error is out of sample.

The calibration's forwards (`kvlab.lossless.calibration`) are never forgotten: each keeps the weight of
one live forward for good (`anchor_weight`). A run that chooses about one draft length round after round
shows the fit noisy verifies of a narrow spread of shapes, which alone price a verify's fixed key read
(c3) against its per-draft work (c4) poorly; the calibration's spread of lengths (1 to 17 tokens) keeps
those directions priced, at a few forwards' weight against the live forwards' (about 50 at `forgetting`
0.98), so the fit still follows the machine where the live forwards say something.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab.attention import FOLDED_SCORES_MAX_QUERIES

# Feature units: thousands of keys, hundreds of thousands of query-key pairs (keeps the system well scaled).
KEYS_UNIT = 1e3
PAIRS_UNIT = 1e5
NUM_FEATURES = 7
# A calibration over T keys stands for caches up to this many times longer.
CALIBRATION_COVERAGE = 2
# Forwards a fit has seen before an outlier is clipped to `ForwardCostModel.max_ratio` x its prediction.
MIN_FORWARDS_TO_CLIP = 8


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentShape:
    """What one segment of a forward feeds and reads.

    Attributes:
        num_tokens: q, tokens it feeds.
        num_cached: T, tokens its cache holds before the forward (stored ones: a compressed cache's kept).
        tier_bytes: Bytes of full KV it reads over a slower tier's link (0 in memory).
    """

    num_tokens: int
    num_cached: int
    tier_bytes: int = 0


def features(segments: list[SegmentShape], kernel_queries: int = 1) -> list[float]:
    """[1, tokens, keys of segments the kernel takes / KEYS_UNIT, keys of the others / KEYS_UNIT, extra
    query-key pairs / PAIRS_UNIT of the kernel's segments, of the others up to FOLDED_SCORES_MAX_QUERIES
    queries, and of longer ones] of a forward over `segments` (a segment's extra pairs: those of its queries
    past its first; the kernel takes segments of 1 to `kernel_queries` queries)."""
    keys = [0.0, 0.0]
    pairs = [0.0, 0.0, 0.0]
    for segment in segments:
        read = segment.num_cached + segment.num_tokens
        extra = max(segment.num_tokens - 1, 0) * read
        if segment.num_tokens <= kernel_queries:
            path = 0
        elif segment.num_tokens <= FOLDED_SCORES_MAX_QUERIES:
            path = 1
        else:
            path = 2
        if segment.num_tokens > 0:
            keys[min(path, 1)] += read
            pairs[path] += extra
    return [1.0, float(sum(s.num_tokens for s in segments)), keys[0] / KEYS_UNIT, keys[1] / KEYS_UNIT,
            *(p / PAIRS_UNIT for p in pairs)]


def marginal_features(segment: SegmentShape, num_sharing: float, kernel_queries: int = 1) -> list[float]:
    """One segment's share of a forward it shares with `num_sharing` segments (itself included): an equal
    part of the fixed cost, all of its own work."""
    own = features([segment], kernel_queries)
    return [1.0 / max(num_sharing, 1.0), *own[1:]]


@dataclasses.dataclass(slots=True)
class LinearFit:
    """Least squares with forgetting and a ridge, over forwards of one set of weights.

    Attributes:
        forgetting: Weight of the past per new forward (0..1].
        ridge: Added to the normal equations' diagonal (keeps collinear features bounded).
        gram: [7, 7] float64 sum of x x^T, forgotten geometrically.
        moments: [7] float64 sum of x y.
        anchor_weight: Weight of an anchored forward (a calibration's), never forgotten.
        anchors: [7, 8] float64 sum of anchor_weight x [x, y]^T over anchored forwards.
        num_observed: Forwards folded in (anchored ones included).
        coefficients: [7] the current fit (seconds per unit of each feature).
    """

    forgetting: float = 0.98
    ridge: float = 1e-4
    anchor_weight: float = 1.0
    gram: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(NUM_FEATURES, NUM_FEATURES,
                                                                                 dtype=torch.float64))
    moments: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(NUM_FEATURES, dtype=torch.float64))
    anchors: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(NUM_FEATURES, NUM_FEATURES + 1,
                                                                                   dtype=torch.float64))
    num_observed: int = 0
    coefficients: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(NUM_FEATURES,
                                                                                        dtype=torch.float64))
    _values: list[float] = dataclasses.field(default_factory=lambda: [0.0] * NUM_FEATURES)

    def predict(self, x: list[float]) -> float:
        # Plain floats: the planner predicts dozens of shapes per round, a tensor op each would cost more.
        return sum(c * v for c, v in zip(self._values, x, strict=True))

    def observe(self, x: list[float], seconds: float, anchored: bool = False) -> None:
        row = torch.tensor(x, dtype=torch.float64)
        if anchored:
            self.anchors.add_(self.anchor_weight * torch.outer(row, torch.tensor([*x, seconds], dtype=torch.float64)))
        else:
            self.gram.mul_(self.forgetting).add_(torch.outer(row, row))
            self.moments.mul_(self.forgetting).add_(row * seconds)
        self.num_observed += 1
        self.coefficients = self._solve()
        self._values = self.coefficients.tolist()

    def _solve(self) -> torch.Tensor:
        """Non-negative least squares by elimination: solve, drop the most negative coefficient, repeat."""
        active = list(range(NUM_FEATURES))
        solution = torch.zeros(NUM_FEATURES, dtype=torch.float64)
        gram_all = self.gram + self.anchors[:, :NUM_FEATURES]
        moments_all = self.moments + self.anchors[:, NUM_FEATURES]
        while active:
            index = torch.tensor(active)
            gram = gram_all[index][:, index] + self.ridge * torch.eye(len(active), dtype=torch.float64)
            partial = torch.linalg.solve(gram, moments_all[index])
            if bool((partial >= 0).all()):
                solution[index] = partial
                return solution
            del active[int(partial.argmin())]
        return solution


@dataclasses.dataclass(slots=True)
class CostFit:
    """How well the model predicted the forwards it was shown, each predicted before it was folded in.

    Attributes:
        num_ticks: Ticks compared (after each weight set's first `warm_up` forwards).
        mean_relative_error: Mean of |predicted - measured| / measured over those ticks.
        predicted_s, measured_s: Their total seconds (the tier's waits excluded from both).
    """

    num_ticks: int = 0
    mean_relative_error: float = 0.0
    predicted_s: float = 0.0
    measured_s: float = 0.0

    def add(self, predicted: float, measured: float) -> None:
        if measured <= 0:
            return
        error = abs(predicted - measured) / measured
        self.num_ticks += 1
        self.mean_relative_error += (error - self.mean_relative_error) / self.num_ticks
        self.predicted_s += predicted
        self.measured_s += measured


@dataclasses.dataclass(slots=True)
class ForwardCostModel:
    """Predicted seconds of packed forwards and of one segment's share of them (see the module docstring).

    Attributes:
        fits: One `LinearFit` per set of weights (keyed "same", "bf16", "int8", "int4").
        link_bytes_per_s: The tier link's rate, when the full KV lives on a slower tier.
        kernel_queries: The most queries of a segment the C++ split-KV kernel takes for the served model
            (`kvlab.attention_kernels.newest_kernel_queries`; 1 where it does not run).
        fit: The out-of-sample record of every tick.
        warm_up: Forwards of a weight set not compared (nor fitted): the first ones pay one-off set-ups.
        max_ratio: A fitted forward counts at most this multiple of its prediction (once the fit has seen
            MIN_FORWARDS_TO_CLIP forwards): a stall on a shared machine is not a new cost.
        calibration: Every calibration forward folded in, per weight set: its features and seconds (what
            `kvlab.lossless.calibration.CalibrationStore` keeps for later runs on this machine).
        calibrated_batch: The largest batch a calibration has run.
    """

    fits: dict[str, LinearFit] = dataclasses.field(default_factory=dict)
    link_bytes_per_s: float | None = None
    kernel_queries: int = 1
    fit: CostFit = dataclasses.field(default_factory=CostFit)
    warm_up: int = 1
    max_ratio: float = 2.0
    calibration: dict[str, list[list[float]]] = dataclasses.field(default_factory=dict)
    calibrated_batch: int = 1
    _seen: dict[str, int] = dataclasses.field(default_factory=dict)

    def ready(self, weights: str) -> bool:
        """Whether forwards on `weights` have been fitted at all."""
        return weights in self.fits and self.fits[weights].num_observed > 0

    def forward_s(self, weights: str, segments: list[SegmentShape]) -> float:
        """Predicted compute seconds of one forward (the tier's wait excluded)."""
        fit = self.fits.get(weights)
        return 0.0 if fit is None else fit.predict(features(segments, self.kernel_queries))

    def share_s(self, weights: str, segment: SegmentShape, num_sharing: float) -> float:
        """Predicted compute seconds one segment adds to a forward it shares with `num_sharing` segments."""
        fit = self.fits.get(weights)
        return 0.0 if fit is None else fit.predict(marginal_features(segment, num_sharing, self.kernel_queries))

    def link_s(self, num_bytes: int) -> float:
        """Seconds `num_bytes` of full KV take over the tier's link (0 in memory)."""
        return num_bytes / self.link_bytes_per_s if num_bytes and self.link_bytes_per_s else 0.0

    def observe_tick(self, forwards: list[tuple[str, list[SegmentShape], float]], calibration: bool = False) -> None:
        """Fold in one tick's forwards: (weights, segments, compute seconds with the tier's wait taken out).

        The tick's prediction is compared first, when every weight set in it is past its warm-up; a
        `calibration`'s is not, and its forwards are anchored (never forgotten) and kept in `calibration`."""
        compared = not calibration and all(self._seen.get(weights, 0) >= self.warm_up and self.ready(weights)
                       for weights, _, _ in forwards)
        if compared and forwards:
            predicted = sum(self.forward_s(weights, segments) for weights, segments, _ in forwards)
            self.fit.add(predicted, sum(seconds for _, _, seconds in forwards))
        for weights, segments, seconds in forwards:
            seen = self._seen.get(weights, 0)
            self._seen[weights] = seen + 1
            if seen < self.warm_up:
                continue
            fit = self.fits.setdefault(weights, LinearFit())
            x = features(segments, self.kernel_queries)
            if fit.num_observed >= MIN_FORWARDS_TO_CLIP:
                # One forward slowed by the shared machine counts at most `max_ratio` times its prediction:
                # the fit follows drift over several forwards, not a single stall.
                seconds = min(seconds, self.max_ratio * max(fit.predict(x), 1e-6))
            fit.observe(x, seconds, anchored=calibration)
            if calibration:
                self.calibration.setdefault(weights, []).append([*x, seconds])

    def calibration_covers(self, weights: str, num_cached: int) -> bool:
        """Whether `weights` has a calibration forward over at least half of `num_cached` keys."""
        rows = self.calibration.get(weights, [])
        return any((row[2] + row[3]) * KEYS_UNIT * CALIBRATION_COVERAGE >= num_cached for row in rows)

    def restore(self, calibration: dict[str, list[list[float]]], calibrated_batch: int) -> None:
        """Fold in an earlier run's calibration forwards (`calibration`'s rows), anchored, as if measured now.

        The first live forward of each weight set is still taken as its warm-up."""
        for weights, rows in calibration.items():
            fit = self.fits.setdefault(weights, LinearFit())
            for row in rows:
                fit.observe(row[:NUM_FEATURES], row[NUM_FEATURES], anchored=True)
            self.calibration.setdefault(weights, []).extend(rows)
        self.calibrated_batch = max(self.calibrated_batch, calibrated_batch)

    def coefficients(self) -> dict[str, list[float]]:
        """Each weight set's fitted [c0, .., c6] (seconds per feature unit)."""
        return {weights: [float(c) for c in fit.coefficients] for weights, fit in self.fits.items()}
