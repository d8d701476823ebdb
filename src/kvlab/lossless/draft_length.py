"""How many tokens to draft next: fixed, or adapted to measured acceptance and forward costs, down to
none at all (the sequence stands aside and takes plain steps) when drafting does not pay."""

from __future__ import annotations

import dataclasses

from kvlab.lossless.gate import DraftingGate


@dataclasses.dataclass(slots=True)
class StepCosts:
    """Measured seconds a sequence adds to a forward: per drafted token, per verify, per plain step.

    Forwards pack several sequences, drafting and verifying, so costs are estimated per segment:
    a forward with only draft segments gives the cost of one draft segment; a forward whose full-cache
    segments all feed one token (plain steps: plain requests, or lossless ones standing aside) gives
    the cost of a plain step; a forward with longer verifies gives, after the other segments' share,
    the cost of one verify (the full-KV read and any wait for the tier included). Exponential moving
    averages with weight `decay` on history. `max_segments` is the most segments one forward of the run
    packed (1: the run has decoded one sequence at a time).
    """

    decay: float = 0.7
    draft_s: float = 0.0
    verify_s: float = 0.0
    plain_s: float = 0.0
    max_segments: int = 0

    def observe(self, seconds: float, num_draft_segments: int, full_segment_tokens: list[int]) -> None:
        """Fold in one forward of `num_draft_segments` draft segments and full-cache segments feeding
        `full_segment_tokens` tokens each."""
        num_verify = sum(tokens > 1 for tokens in full_segment_tokens)
        num_plain = len(full_segment_tokens) - num_verify
        self.max_segments = max(self.max_segments, num_draft_segments + len(full_segment_tokens))
        if not full_segment_tokens:
            if num_draft_segments:
                self.draft_s = self._average(self.draft_s, seconds / num_draft_segments)
            return
        others = num_draft_segments * self.draft_s
        if num_verify == 0:
            self.plain_s = self._average(self.plain_s, max(seconds - others, 0.0) / num_plain)
            return
        verify = max(seconds - others - num_plain * self.plain_s, 0.0) / num_verify
        self.verify_s = self._average(self.verify_s, verify)

    @property
    def plain_step_s(self) -> float:
        """A plain step's cost: measured, else a verify's (which feeds more tokens over the same KV)."""
        return self.plain_s or self.verify_s

    def _average(self, old: float, new: float) -> float:
        return new if old == 0 else self.decay * old + (1 - self.decay) * new


@dataclasses.dataclass(slots=True)
class DraftLengthController:
    """Chooses the draft length of each round of one sequence.

    With `fixed` set, always drafts that many. Otherwise it models acceptance as geometric: each draft
    token is accepted with probability alpha given the previous ones were, so a round drafting k
    tokens emits (1 - alpha^(k+1)) / (1 - alpha) tokens on average. It estimates alpha from this
    sequence's recent rounds and takes the costs from the run's shared `StepCosts`, and picks the k in
    [1, max_num_draft_tokens] that maximizes expected tokens per second. Same-model drafters with a
    dominant-attention cache accept long runs, so k grows to tens of tokens; weak drafters stay short.

    Stepping aside: when even the best k is expected to emit fewer tokens per second than a plain
    step (one token per `StepCosts.plain_step_s`), it drafts nothing: the round is a plain step on the
    full cache, whose exact KV still reaches the draft cache. Every `probe_interval` rounds aside it
    drafts `probe_num_draft_tokens` again to measure acceptance anew (few: a probe that fails costs its
    drafts and a longer verify); a probe that does not pay
    doubles the interval (up to `max_probe_interval`), one that does returns the sequence to drafting.
    A probe is drafted only where drafting could pay at all: where a round of
    `ceiling_num_draft_tokens` drafts, every one accepted, would beat plain steps by `min_probe_gain`.
    On a short prompt a draft forward costs about what a plain step does (the weights dominate), so no
    acceptance could pay and a probe would only cost.

    Until a plain step has been timed, its cost is taken to be a verify's, which flatters drafting (a
    verify feeds more tokens over the same KV: 1.1-1.5x a plain step here). So where a sequence
    decoding alone is expected to beat that estimate by less than `plain_measure_gain`, it takes one
    plain round to time it: a plain round costs nothing against plain decoding. Only alone: packed
    beside others, a plain segment's share of a forward is not its cost (the segments split the
    weights' read, which per-segment costs cannot apportion; at batch 4, 8K, timing them made the
    sequences stand aside in 61 of 90 and 88 of 110 rounds, 12.6 and 13.3 tokens/s against 13.4 and
    14.7 without the rule), so the rule holds only in runs that never packed two sequences.

    Under `auto` the run's `DraftingGate` has the last word: while it finds plain steps faster than
    drafting (timed, not modelled), every round is a plain step.

    Attributes:
        costs: Measured per-segment costs, shared by the sequences of a run.
        fixed: A fixed draft length, or None to adapt.
        gate: The run's measured verdict on drafting, shared by its sequences (None: always open).
        initial_num_draft_tokens: Draft length of a new sequence's first round when adapting: short,
            since its acceptance is unknown and a long first round is paid for by every sequence packed
            beside it (at batch 4, 2K context, first rounds of 8 cost 14% of a 64-token run). A round
            that is all accepted lets the next one grow at once.
        probe_num_draft_tokens: Draft length of a probe after rounds aside.
        ceiling_num_draft_tokens: The round length whose every-draft-accepted rate says whether drafting
            could pay at all.
        max_num_draft_tokens: Upper bound of adaptive lengths.
        decay: Weight of history in the acceptance averages (0..1).
        min_probe_interval, max_probe_interval: Rounds aside between probes, at first and at most.
        min_probe_gain: How much faster than plain steps a round with every draft accepted must be for a
            probe to be worth drafting.
        plain_measure_gain: Below this expected gain over a verify's cost, an untimed plain step is timed.
        num_stood_aside: Rounds it chose to draft nothing.
    """

    costs: StepCosts
    fixed: int | None = None
    gate: DraftingGate | None = None
    initial_num_draft_tokens: int = 2
    probe_num_draft_tokens: int = 2
    ceiling_num_draft_tokens: int = 8
    max_num_draft_tokens: int = 64
    decay: float = 0.7
    min_probe_interval: int = 8
    max_probe_interval: int = 64
    min_probe_gain: float = 1.1
    plain_measure_gain: float = 1.5
    accepted: float = 0.0
    rejected: float = 0.0
    num_stood_aside: int = 0
    probe_interval: int = 0
    _aside_since_probe: int = 0
    _timed_plain: bool = False

    def drafting_allowed(self) -> bool:
        """Whether this round may draft at all (prompt lookup included): a fixed length always does."""
        return self.fixed is not None or self.gate is None or self.gate.allows_drafting()

    def transit_num_draft_tokens(self) -> int:
        """Drafts of a remote start's round while its exact prefix is in transit: the wait is paid anyway, so
        neither the gate nor the costs shorten it (it verifies once the prefix lands); a fixed length holds."""
        return self.fixed if self.fixed is not None else self.ceiling_num_draft_tokens

    def next_num_draft_tokens(self) -> int:
        if self.fixed is not None:
            return self.fixed
        if not self.drafting_allowed():
            return 0  # the run's gate found plain steps faster: not this sequence's own choice
        if self.costs.verify_s == 0 or self.costs.draft_s == 0:
            return self.initial_num_draft_tokens  # nothing measured yet: this round measures
        if self.accepted + self.rejected == 0:
            # A new sequence in a run whose costs are known: it drafts unless no acceptance could pay.
            return self.initial_num_draft_tokens if self._drafting_could_pay() else self._stand_aside()
        best_length, best_rate = self._best_length()
        if best_rate * self.costs.plain_step_s < 1.0:
            return self._stand_aside()
        narrow = best_rate * self.costs.verify_s < self.plain_measure_gain
        alone = self.costs.max_segments == 1  # no forward of this run has packed two sequences
        if narrow and alone and not self.costs.plain_s and not self._timed_plain:
            # Only a sequence decoding alone: in a packed batch the segments share the weights' read, so
            # a forward of plain segments alone gives each a share no verify beside drafts gets.
            self._timed_plain = True
            self.num_stood_aside += 1
            return 0
        self.probe_interval = 0
        return best_length

    def _stand_aside(self) -> int:
        """0 (a plain round), or a probe's draft length when one is due and drafting could pay."""
        if not self.probe_interval:  # it stops paying now: probe again after the shortest interval
            self.probe_interval, self._aside_since_probe = self.min_probe_interval, 0
        if self._aside_since_probe >= self.probe_interval:
            self._aside_since_probe = 0
            self.probe_interval = min(2 * self.probe_interval, self.max_probe_interval)
            if self._drafting_could_pay():
                return self.probe_num_draft_tokens
        self._aside_since_probe += 1
        self.num_stood_aside += 1
        return 0

    def expected_rate(self) -> float:
        """Tokens per second this sequence expects from its next round, drafting from the compressed cache
        or standing aside, whichever pays (0 until its acceptance and the costs are measured)."""
        if self.accepted + self.rejected == 0 or self.costs.verify_s == 0 or self.costs.draft_s == 0:
            return 0.0
        plain_rate, best_rate = 1.0 / self.costs.plain_step_s, self._best_length()[1]
        return plain_rate if self.fixed is None and best_rate < plain_rate else best_rate

    def _drafting_could_pay(self) -> bool:
        """Whether a round of `ceiling_num_draft_tokens` drafts, all accepted, beats plain steps by
        `min_probe_gain` at the measured costs."""
        length = self.ceiling_num_draft_tokens
        ceiling = (length + 1) / (length * self.costs.draft_s + self.costs.verify_s)
        return ceiling * self.costs.plain_step_s >= self.min_probe_gain

    def _best_length(self) -> tuple[int, float]:
        """The draft length with the most expected tokens per second, and that rate."""
        # Laplace smoothing keeps alpha below 1 so the expected gain stays finite.
        alpha = (self.accepted + 0.5) / (self.accepted + self.rejected + 1.0)
        best_length, best_rate = 1, 0.0
        for length in range(1, self.max_num_draft_tokens + 1):
            expected_tokens = (1 - alpha ** (length + 1)) / (1 - alpha)
            rate = expected_tokens / (length * self.costs.draft_s + self.costs.verify_s)
            if rate > best_rate:
                best_length, best_rate = length, rate
        return best_length, best_rate

    def update(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Fold in one round of this sequence."""
        if num_draft_tokens == 0:
            return
        self.accepted = self.decay * self.accepted + num_accepted_tokens
        self.rejected = self.decay * self.rejected + (num_accepted_tokens < num_draft_tokens)
