"""Token-to-token prediction of quantized codes, and the entropy that bounds any coder of them.

Each channel's code is predicted by the same channel's code one token earlier; what is coded is the
residual modulo `2**bits`, so residuals stay in the codes' alphabet and undo exactly.
"""

from __future__ import annotations

import numpy as np


def token_residuals(codes: np.ndarray, bits: int) -> np.ndarray:
    """`[lead, t, D]` uint8 residuals of `[lead, t, D]` codes: the first token as is, then differences mod 2**bits."""
    residuals = codes.astype(np.int16)
    residuals[:, 1:] -= codes[:, :-1]
    return (residuals % (1 << bits)).astype(np.uint8)


def undo_token_residuals(residuals: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `token_residuals`: uint8 codes of the same shape."""
    return (np.cumsum(residuals, axis=1, dtype=np.int64) % (1 << bits)).astype(np.uint8)


def entropy_bits(symbols: np.ndarray, contexts: np.ndarray | None = None) -> float:
    """Empirical entropy in bits per symbol of `symbols`, conditioned on `contexts` (same shape) when given.

    The conditional entropy `H(symbol | context)` bounds what a coder with one adaptive model per
    context can reach, up to the cost of learning the models.
    """
    flat = symbols.reshape(-1).astype(np.int64)
    if flat.size == 0:
        return 0.0
    if contexts is None:
        return _entropy(flat)
    context_flat = np.broadcast_to(contexts, symbols.shape).reshape(-1).astype(np.int64)
    joint = context_flat * (int(flat.max()) + 1) + flat
    return _entropy(joint) - _entropy(context_flat)


def channel_contexts(shape: tuple[int, int, int]) -> np.ndarray:
    """`[lead, 1, D]` context ids, one per channel of each head, for `entropy_bits` over `[lead, t, D]` codes."""
    lead, _, channels = shape
    return np.arange(lead * channels, dtype=np.int64).reshape(lead, 1, channels)


def _entropy(flat: np.ndarray) -> float:
    _, counts = np.unique(flat, return_counts=True)
    probabilities = counts / counts.sum()
    return float(-(probabilities * np.log2(probabilities)).sum())
