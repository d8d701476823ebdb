"""The scheduler: which sequences wait, prefill and decode.

Admission is in arrival order among the sequences that are ready: a sequence whose prefix is still
being fetched in the background waits without holding up the ones behind it (no head-of-line
blocking), and joins once its KV has landed. At most `max_num_seqs` sequences prefill or decode at
once. Prefill either runs one piece per tick, so a long prompt never stalls the running streams for
more than one piece (a server), or completes every admitted prompt before decoding (offline batches).

Interleaved prefill is shared round-robin among the prefilling sequences: each tick prefills one
piece of the sequence at the head of the line, which then goes to the back (unless that piece was its
last). So a prompt of k pieces beside n others prefilling starts decoding within about k x (n + 1)
ticks, whatever their lengths: a short request beside a 6,000-token prompt waits for a few pieces of
it, not for all of them, and the long prompt still gets a piece every n + 1 ticks (no one starves).
Each tick still costs one piece, so the running streams see the same bound as before.

Within the running sequences, what each lossless sequence's next round does (which drafter, how many
tokens, or a plain step) is the scheduler's `planner`'s decision (`kvlab.lossless.planner`), from the
cost model it fits to the engine's forwards and each sequence's own acceptance; the planner sees the
batch as the tick left it.
"""

from __future__ import annotations

import collections

from kvlab.engine.sequence import Sequence, Status
from kvlab.lossless.cost_model import ForwardCostModel
from kvlab.lossless.planner import RoundPlanner


class Scheduler:
    """The engine's queues.

    Args:
        max_num_seqs: Sequences prefilling or decoding at once (None: no limit).
        interleave_prefill: One prefill piece per tick (True), or whole prompts before decoding.
    """

    def __init__(self, max_num_seqs: int | None, interleave_prefill: bool) -> None:
        self.max_num_seqs = max_num_seqs
        self.interleave_prefill = interleave_prefill
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.planner = RoundPlanner(ForwardCostModel())

    def __len__(self) -> int:
        """Sequences not finished yet."""
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def admit(self) -> None:
        """Move ready waiting sequences into prefill, in arrival order, while there is room."""
        for sequence in list(self.waiting):
            if not self._has_room():
                return
            if sequence.ready:
                self.waiting.remove(sequence)
                sequence.status = Status.PREFILLING
                self.prefilling.append(sequence)

    def to_prefill(self) -> list[Sequence]:
        """The sequences to prefill this tick: the next in the round-robin (a piece of it; it moves to the
        back of the line), or every admitted one (whole prompts)."""
        if not self.prefilling:
            return []
        if not self.interleave_prefill:
            return list(self.prefilling)
        sequence = self.prefilling[0]
        self.prefilling.rotate(-1)
        return [sequence]

    def start_running(self, sequence: Sequence) -> None:
        self.prefilling.remove(sequence)
        self.running.append(sequence)

    def remove(self, sequence: Sequence) -> None:
        """Take `sequence` out of whichever queue holds it."""
        for queue in (self.waiting, self.prefilling, self.running):
            if sequence in queue:
                queue.remove(sequence)
                return

    def _has_room(self) -> bool:
        return self.max_num_seqs is None or len(self.prefilling) + len(self.running) < self.max_num_seqs
