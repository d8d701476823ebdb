"""Adaptive range coding of many independent symbol lanes at once, vectorized with numpy.

The coder is Subbotin's carry-less range coder (32-bit low and range, bytes out when the top byte
settles, range forced down on underflow). Each lane is its own coder with its own byte stream; lanes
advance together, one symbol per step, so every numpy operation works on all lanes. Lanes that share
a context share an adaptive frequency model: counts of the symbols coded so far, refreshed after
steps 1, 2, 4, 8, 16, 32 and then every 32 steps (encoder and decoder refresh at the same steps from
the same symbols, so no table is transmitted). Between refreshes the model is static, which is what
makes the per-step work vectorizable.

Pure Python/numpy: correct and portable, not fast (tens of MB/s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from kvlab.codec.errors import CodecError

MASK = np.uint64(0xFFFFFFFF)
TOP = np.uint64(1 << 24)
BOTTOM = np.uint64(1 << 16)
# Frequency budget of a model; at most BOTTOM so that range // total stays >= 1.
TOTAL = 1 << 14
MAX_ALPHABET = 1 << 12
REFRESH_PERIOD = 32
# One step shifts out at most 4 bytes (range grows 256x per shift); more means a broken state.
MAX_SHIFTS = 4


class AdaptiveModel:
    """Per-context symbol frequencies, rebuilt from running counts at refresh steps."""

    def __init__(self, num_contexts: int, alphabet: int) -> None:
        if not 2 <= alphabet <= MAX_ALPHABET:
            raise ValueError(f"alphabet must be in 2..{MAX_ALPHABET}, got {alphabet}")
        self.alphabet = alphabet
        self.counts = np.zeros((num_contexts, alphabet), dtype=np.int64)
        self.refresh()

    def observe(self, symbols: np.ndarray, active: np.ndarray, contexts: np.ndarray) -> None:
        """Count `symbols` `[k, N]` where `active` `[k, N]` is set, each in its model `contexts` `[k, N]`."""
        keys = (contexts * self.alphabet + symbols)[active]
        self.counts += np.bincount(keys, minlength=self.counts.size).reshape(self.counts.shape)

    def refresh(self) -> None:
        seen = self.counts.sum(axis=1, keepdims=True)
        frequencies = 1 + self.counts * (TOTAL - self.alphabet) // np.maximum(seen, 1)
        cumulative = np.zeros((self.counts.shape[0], self.alphabet + 1), dtype=np.int64)
        np.cumsum(frequencies, axis=1, out=cumulative[:, 1:])
        self.cumulative = cumulative.reshape(-1).astype(np.uint64)
        self.totals = cumulative[:, -1].astype(np.uint64)


def refresh_steps(num_steps: int) -> list[int]:
    early = [step for step in (1, 2, 4, 8, 16) if step < num_steps]
    return early + list(range(REFRESH_PERIOD, num_steps, REFRESH_PERIOD))


@dataclasses.dataclass(frozen=True)
class LaneContexts:
    """Which model codes each lane's symbol at each step.

    Lane n at step s uses model `lanes[n] * cycle + (phases[n] + s) % cycle`: with `cycle = 1` one
    model per lane group; with `cycle = D` over a token-major sequence, one model per channel.
    """

    lanes: np.ndarray  # [N] int64, in [0, num_groups)
    num_groups: int
    cycle: int = 1
    phases: np.ndarray | None = None  # [N] int64; zeros when None

    @property
    def num_contexts(self) -> int:
        return max(self.num_groups, 1) * self.cycle

    def at(self, step: int) -> np.ndarray:
        """`[N]` model of every lane at `step`."""
        if self.cycle == 1:
            return self.lanes
        phases = 0 if self.phases is None else self.phases
        return self.lanes * self.cycle + (phases + step) % self.cycle

    def block(self, start: int, stop: int) -> np.ndarray:
        """`[stop - start, N]` models of every lane at steps `start..stop-1`."""
        return np.stack([self.at(step) for step in range(start, stop)]) if stop > start else \
            np.zeros((0, self.lanes.size), dtype=np.int64)


def encode_lanes(symbols: np.ndarray, lengths: np.ndarray, contexts: LaneContexts, alphabet: int) -> list[bytes]:
    """Range-code each lane's symbols into its own byte string.

    Args:
        symbols: `[S, N]` integers in `[0, alphabet)`; lane n's symbols are `symbols[:lengths[n], n]`.
        lengths: `[N]` symbols per lane, each at least 1.
        contexts: Which adaptive model codes each symbol.
        alphabet: Symbols per model.
    """
    num_steps, num_lanes = symbols.shape
    model = AdaptiveModel(contexts.num_contexts, alphabet)
    low = np.zeros(num_lanes, dtype=np.uint64)
    span = np.full(num_lanes, MASK, dtype=np.uint64)
    out = _Output(num_lanes, 2 * num_steps + 16)
    def write_byte(lanes: np.ndarray) -> None:
        out.put(lanes, (low[lanes] >> np.uint64(24)).astype(np.uint8))

    for step, active in _coding_steps(model, symbols, lengths, contexts):
        context = contexts.at(step)
        index = context * (alphabet + 1) + symbols[step]
        start = model.cumulative[index]
        size = model.cumulative[index + 1] - start
        unit = span // model.totals[context]
        low[:] = np.where(active, (low + unit * start) & MASK, low)
        span[:] = np.where(active, unit * size, span)
        if not _renormalize(low, span, active, write_byte):
            raise AssertionError("range coder state did not renormalize")
    all_lanes = np.arange(num_lanes)
    for _ in range(4):
        out.put(all_lanes, (low >> np.uint64(24)).astype(np.uint8))
        low = (low << np.uint64(8)) & MASK
    return out.streams()


def decode_lanes(streams: list[bytes | memoryview], lengths: np.ndarray, contexts: LaneContexts,
                 alphabet: int) -> np.ndarray:
    """Inverse of `encode_lanes`: `[S, N]` symbols (zero past each lane's length), S = max(lengths).

    Raises:
        CodecError: A stream is shorter or longer than the symbols it claims to hold.
    """
    num_lanes = len(streams)
    num_steps = int(lengths.max()) if num_lanes else 0
    stream_lengths = np.array([len(stream) for stream in streams], dtype=np.int64)
    if num_lanes and stream_lengths.min() < 4:
        raise CodecError("range-coded lane shorter than its 4-byte flush")
    width = int(stream_lengths.max(initial=0)) + 8
    data = np.zeros((num_lanes, width), dtype=np.uint8)
    for lane, stream in enumerate(streams):
        data[lane, : len(stream)] = np.frombuffer(stream, dtype=np.uint8)
    code = np.zeros(num_lanes, dtype=np.uint64)
    for offset in range(4):
        code = (code << np.uint64(8)) | data[:, offset].astype(np.uint64)
    position = np.full(num_lanes, 4, dtype=np.int64)
    model = AdaptiveModel(contexts.num_contexts, alphabet)
    low = np.zeros(num_lanes, dtype=np.uint64)
    span = np.full(num_lanes, MASK, dtype=np.uint64)
    symbols = np.zeros((num_steps, num_lanes), dtype=np.int64)
    search_bits = [1 << bit for bit in reversed(range(max(1, (alphabet - 1).bit_length())))]

    def read_byte(lanes: np.ndarray) -> None:
        next_bytes = data[lanes, np.minimum(position[lanes], width - 1)].astype(np.uint64)
        code[lanes] = ((code[lanes] << np.uint64(8)) | next_bytes) & MASK
        position[lanes] += 1

    for step, active in _coding_steps(model, symbols, lengths, contexts):
        rows = contexts.at(step) * (alphabet + 1)
        totals = model.totals[contexts.at(step)]
        unit = span // totals
        target = np.minimum(((code - low) & MASK) // unit, totals - np.uint64(1))
        found = np.zeros(num_lanes, dtype=np.int64)
        for stride in search_bits:
            candidate = np.minimum(found + stride, alphabet - 1)
            found = np.where(model.cumulative[rows + candidate] <= target, candidate, found)
        start = model.cumulative[rows + found]
        size = model.cumulative[rows + found + 1] - start
        low[:] = np.where(active, (low + unit * start) & MASK, low)
        span[:] = np.where(active, unit * size, span)
        symbols[step] = np.where(active, found, 0)
        if not _renormalize(low, span, active, read_byte):
            raise CodecError("range-coded stream is corrupted (decoder state does not renormalize)")
    if num_lanes and not np.array_equal(position, stream_lengths):
        raise CodecError("range-coded lane length does not match its symbols (corrupted stream)")
    return symbols


def _coding_steps(
    model: AdaptiveModel, symbols: np.ndarray, lengths: np.ndarray, contexts: LaneContexts
) -> Iterator[tuple[int, np.ndarray]]:
    """Each step and its active lanes, refreshing the adaptive model from the symbols coded so far on
    the schedule both sides share (the decoder fills `symbols` in place as it goes)."""
    refresh, last = set(refresh_steps(len(symbols))), 0
    for step in range(len(symbols)):
        if step in refresh:
            model.observe(symbols[last:step], _active(lengths, last, step), contexts.block(last, step))
            model.refresh()
            last = step
        yield step, lengths > step


def _renormalize(
    low: np.ndarray, span: np.ndarray, active: np.ndarray, move_byte: Callable[[np.ndarray], None]
) -> bool:
    """Shift settled bytes out of `low`/`span` (in place) until every active lane's range is wide again.

    `move_byte(lanes)` runs before each shift: the encoder writes the lanes' top byte of `low`, the
    decoder reads the next byte of their streams. False when a lane does not settle (corrupt state).
    """
    for _ in range(MAX_SHIFTS + 1):
        settled, underflow = _needs_shift(low, span)
        shift = (settled | underflow) & active
        if not shift.any():
            return True
        span[:] = np.where(underflow & active, (np.uint64(1 << 32) - low) & (BOTTOM - np.uint64(1)), span)
        lanes = np.flatnonzero(shift)
        move_byte(lanes)
        low[lanes] = (low[lanes] << np.uint64(8)) & MASK
        span[lanes] = (span[lanes] << np.uint64(8)) & MASK
    return False


def _needs_shift(low: np.ndarray, span: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lanes whose top byte is settled, and lanes stuck straddling a byte boundary with a tiny range."""
    settled = (low ^ ((low + span) & MASK)) < TOP
    return settled, ~settled & (span < BOTTOM)


def _active(lengths: np.ndarray, start: int, stop: int) -> np.ndarray:
    return lengths[None, :] > np.arange(start, stop)[:, None]


class _Output:
    """Per-lane byte buffers that grow when a lane outruns them."""

    def __init__(self, num_lanes: int, capacity: int) -> None:
        self.buffer = np.zeros((num_lanes, capacity), dtype=np.uint8)
        self.position = np.zeros(num_lanes, dtype=np.int64)

    def put(self, lanes: np.ndarray, values: np.ndarray) -> None:
        if lanes.size and int(self.position[lanes].max()) >= self.buffer.shape[1]:
            grown = np.zeros((self.buffer.shape[0], 2 * self.buffer.shape[1]), dtype=np.uint8)
            grown[:, : self.buffer.shape[1]] = self.buffer
            self.buffer = grown
        self.buffer[lanes, self.position[lanes]] = values
        self.position[lanes] += 1

    def streams(self) -> list[bytes]:
        return [self.buffer[lane, :length].tobytes() for lane, length in enumerate(self.position.tolist())]
