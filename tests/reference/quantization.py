"""Minimal re-implementations of KIVI's and TurboQuant's quantizers, written from the papers."""

from __future__ import annotations

import math

import numpy as np


def kivi_quantize(groups: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min-max asymmetric quantization of each row of `groups` [G, n] (one group per row).

    Zero and scale are stored in fp16, the zero rounded down and the scale up so the stored range still
    covers the group. Returns (codes, scale, zero) per row.
    """
    levels = 2**bits - 1
    codes = np.zeros(groups.shape, dtype=np.int64)
    scales = np.zeros(groups.shape[0], dtype=np.float16)
    zeros = np.zeros(groups.shape[0], dtype=np.float16)
    for index, group in enumerate(groups.astype(np.float32)):
        zero = _fp16_toward(np.float32(group.min()), down=True)
        scale = _fp16_toward((np.float32(group.max()) - np.float32(zero)) / np.float32(levels), down=False)
        step = np.float32(scale) if scale > 0 else np.float32(1.0)
        codes[index] = np.clip(np.round((group - np.float32(zero)) / step), 0, levels)
        scales[index], zeros[index] = scale, zero
    return codes, scales, zeros


def _fp16_toward(value: np.float32, down: bool) -> np.float16:
    rounded = np.float16(value)
    if down and np.float32(rounded) > value:
        return np.nextafter(rounded, np.float16(-np.inf))
    if not down and np.float32(rounded) < value:
        return np.nextafter(rounded, np.float16(np.inf))
    return rounded


def walsh_hadamard(vectors: np.ndarray) -> np.ndarray:
    """Fast Walsh-Hadamard transform along the last axis (unnormalized), length a power of two."""
    data = vectors.astype(np.float64).copy()
    length = data.shape[-1]
    step = 1
    while step < length:
        for start in range(0, length, 2 * step):
            left = data[..., start : start + step].copy()
            right = data[..., start + step : start + 2 * step].copy()
            data[..., start : start + step] = left + right
            data[..., start + step : start + 2 * step] = left - right
        step *= 2
    return data


def turboquant_mse_codes(
    vectors: np.ndarray, signs: np.ndarray, centroids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Nearest-centroid codes of the randomized-Hadamard rotation of each unit-normalized vector.

    Returns (codes, distance of each rotated coordinate to the nearest decision boundary).
    """
    dim = vectors.shape[-1]
    unit = vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)
    rotated = walsh_hadamard(unit * signs) / math.sqrt(dim)
    boundaries = (centroids[1:] + centroids[:-1]) / 2
    margin = np.abs(rotated[..., None] - boundaries).min(axis=-1)
    return np.abs(rotated[..., None] - centroids).argmin(axis=-1), margin
