"""The vectorized adaptive range coder: exact round trips, near-entropy sizes, corruption detected."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab.codec import CodecError
from kvlab.codec.rangecoder import LaneContexts, decode_lanes, encode_lanes


def skewed_lanes(alphabet: int, steps: int, lanes: int, contexts: int, seed: int = 0
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    probabilities = rng.dirichlet(np.full(alphabet, 0.3), size=contexts)
    lane_contexts = rng.integers(0, contexts, lanes)
    symbols = np.stack([rng.choice(alphabet, size=steps, p=probabilities[c]) for c in lane_contexts], axis=1)
    lengths = rng.integers(1, steps + 1, lanes)
    lengths[0] = steps
    for lane, length in enumerate(lengths):
        symbols[length:, lane] = 0
    return symbols, lengths, lane_contexts, probabilities


@pytest.mark.parametrize(("alphabet", "steps", "lanes", "contexts"),
                         [(2, 1, 1, 1), (4, 60, 7, 3), (16, 500, 30, 4), (256, 300, 20, 5), (4096, 50, 3, 1)])
def test_lanes_round_trip_exactly(alphabet: int, steps: int, lanes: int, contexts: int) -> None:
    symbols, lengths, lane_contexts, _ = skewed_lanes(alphabet, steps, lanes, contexts)
    streams = encode_lanes(symbols, lengths, LaneContexts(lane_contexts, contexts), alphabet)
    decoded = decode_lanes(streams, lengths, LaneContexts(lane_contexts, contexts), alphabet)
    mismatch = np.argwhere(decoded != symbols)
    assert mismatch.size == 0, f"first mismatch at step, lane {tuple(mismatch[0])}"


def test_coded_size_is_close_to_the_source_entropy() -> None:
    symbols, lengths, lane_contexts, probabilities = skewed_lanes(16, 4000, 8, 2, seed=1)
    streams = encode_lanes(symbols, lengths, LaneContexts(lane_contexts, 2), 16)
    entropy_bits = sum(-np.log2(probabilities[lane_contexts[lane]][symbols[: lengths[lane], lane]]).sum()
                       for lane in range(len(lengths)))
    coded_bits = 8 * sum(len(stream) for stream in streams)
    assert coded_bits < 1.05 * entropy_bits + 8 * 4 * len(streams), (coded_bits, entropy_bits)


def test_a_lane_missing_its_last_byte_is_detected() -> None:
    symbols, lengths, lane_contexts, _ = skewed_lanes(16, 200, 4, 2)
    streams = encode_lanes(symbols, lengths, LaneContexts(lane_contexts, 2), 16)
    streams[2] = streams[2][:-1]
    with pytest.raises(CodecError):
        decode_lanes(streams, lengths, LaneContexts(lane_contexts, 2), 16)


def test_a_lane_shorter_than_its_flush_is_rejected() -> None:
    with pytest.raises(CodecError, match="flush"):
        decode_lanes([b"\x00\x01"], np.array([3]), LaneContexts(np.array([0]), 1), 4)


def test_cycling_contexts_round_trip_and_learn_per_channel_statistics() -> None:
    rng = np.random.default_rng(2)
    channels, steps, lanes = 4, 800, 6
    # Channel c always emits symbol c: one model per channel learns it, a shared model cannot.
    phases = rng.integers(0, channels, lanes)
    symbols = ((phases[None, :] + np.arange(steps)[:, None]) % channels).astype(np.int64)
    lengths = np.full(lanes, steps)
    per_channel = LaneContexts(np.zeros(lanes, dtype=np.int64), 1, cycle=channels, phases=phases)
    shared = LaneContexts(np.zeros(lanes, dtype=np.int64), 1)
    streams = encode_lanes(symbols, lengths, per_channel, channels)
    assert np.array_equal(decode_lanes(streams, lengths, per_channel, channels), symbols)
    shared_bytes = sum(map(len, encode_lanes(symbols, lengths, shared, channels)))
    assert sum(map(len, streams)) < shared_bytes / 4
