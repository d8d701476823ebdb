"""Pack integer codes of any width 1..8 bits densely into bytes, and back (pure numpy functions).

Widths that divide 8 pack `8 // bits` codes per byte, the first code in the low bits; other widths
(3, 5, 6, 7) use a bit stream, most significant bit of each code first.
"""

from __future__ import annotations

import numpy as np


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Flattened codes in [0, 2**bits) packed into ceil(size * bits / 8) uint8 bytes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    flat = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if 8 % bits:
        return np.packbits(np.unpackbits(flat[:, None], axis=1)[:, 8 - bits :].reshape(-1))
    per_byte = 8 // bits
    padded = np.zeros(-(-flat.size // per_byte) * per_byte, dtype=np.uint8)
    padded[: flat.size] = flat
    lanes = padded.reshape(-1, per_byte)
    packed = np.zeros(lanes.shape[0], dtype=np.uint8)
    for slot in range(per_byte):
        packed |= lanes[:, slot] << np.uint8(bits * slot)
    return packed


def unpack_codes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of `pack_codes`: the first `count` codes as a flat uint8 array."""
    if 8 % bits:
        stream = np.unpackbits(packed)[: count * bits].reshape(count, bits)
        widened = np.zeros((count, 8), dtype=np.uint8)
        widened[:, 8 - bits :] = stream
        return np.packbits(widened, axis=1).reshape(-1)
    per_byte = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    lanes = np.stack([(packed >> np.uint8(bits * slot)) & mask for slot in range(per_byte)], axis=1)
    return lanes.reshape(-1)[:count]


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes `pack_codes` produces for `count` codes."""
    return (count * bits + 7) // 8
