"""TurboQuant: random rotation, optimal scalar codebook, 1-bit QJL residual for unbiased keys."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import numpy as np
import torch

from kvlab.compress.base import FP16_BYTES, MAX_SEED, check_range, compressors
from kvlab.compress.quantization import (
    FULL_PRECISION_BITS,
    QuantizationCompressor,
    QuantizedBlock,
    pack_code_tensor,
    unpack_code_tensor,
)
from kvlab.quant.packing import packed_nbytes

SEED_BYTES = 8


@dataclasses.dataclass(slots=True)
class TurboQuantBlock(QuantizedBlock):
    """Rotated, scalar-quantized vectors of a run of tokens.

    Attributes:
        packed: Codebook indices (`code_bits` each), flat.
        norms: [H_kv, n] fp16 norm of each vector.
        shape: [H_kv, n, D].
        code_bits: Bits per coordinate of the codebook index.
        seed: Seed of the rotation (and of the QJL sketch).
        packed_signs: QJL sign bits of the residual (keys only), flat, or None.
        residual_norms: [H_kv, n] fp16 norm of the residual (keys only), or None.
    """

    packed: torch.Tensor
    norms: torch.Tensor
    shape: tuple[int, int, int]
    code_bits: int
    seed: int
    packed_signs: torch.Tensor | None = None
    residual_norms: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:  # type: ignore[override]
        return self.shape[1]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    def nbytes(self) -> int:
        total = packed_nbytes(self.numel, self.code_bits) + self.norms.numel() * FP16_BYTES
        if self.residual_norms is not None:
            total += packed_nbytes(self.numel, 1) + self.residual_norms.numel() * FP16_BYTES
        return total


@compressors.register("turboquant")
@dataclasses.dataclass
class TurboQuantCompressor(QuantizationCompressor):
    """TurboQuant (Zandieh et al., 2025, "TurboQuant: Online Vector Quantization with Near-optimal
    Distortion Rate").

    Family: quantization. Each key/value vector is normalised (its norm stored in fp16) and rotated by
    a seeded random orthogonal matrix (randomized Hadamard when head_dim is a power of two), which
    makes every coordinate follow the same known distribution, (1 - t^2)^((d-3)/2) on [-1, 1]; each
    coordinate is coded with the Lloyd-Max codebook of that distribution. Values use all `bits` for
    the codebook (TurboQuant-mse). Keys use `bits - 1` and spend the last bit on a QJL sketch of the
    residual, sign(S r) with a seeded Gaussian S, plus the residual norm, so that inner products with
    queries are unbiased (TurboQuant-prod).

    Budget: `bits` per coordinate (2, 3 or 4; 16 is the identity), plus fp16 norms; data-oblivious,
    so tokens are quantized as they arrive unless `residual_length` keeps recent ones exact.

    Deviations from the paper:
    - Attention reads a dequantized copy of the keys, materialized with the unbiased QJL estimator
      x_mse + sqrt(pi/2) / d * |r| * S^T sign(S r), instead of evaluating the estimator per query.
    - Outlier channels are not split into a higher-bit group (the paper's 2.5/3.5-bit settings).
    """

    allowed_bits: ClassVar[tuple[int, ...]] = (2, 3, 4, FULL_PRECISION_BITS)

    residual_length: int = dataclasses.field(default=0, metadata={"help": "most recent tokens kept in full precision"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of rotations and QJL sketches"})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("seed", self.seed, 0, MAX_SEED)

    def overhead_nbytes(self) -> int:
        return SEED_BYTES

    def quantize_keys(self, keys: torch.Tensor, layer_idx: int) -> TurboQuantBlock:
        seed = self._seed(layer_idx, "keys")
        block, reconstruction = _quantize_mse(keys, self.bits - 1, seed)
        residual = keys.float() - reconstruction
        sketch = _qjl_matrix(keys.shape[-1], seed, keys.device)
        signs = (residual @ sketch.T >= 0).to(torch.uint8)
        block.packed_signs = pack_code_tensor(signs, 1)
        block.residual_norms = residual.norm(dim=-1).to(torch.float16)
        return block

    def dequantize_keys(self, block: QuantizedBlock) -> torch.Tensor:
        assert isinstance(block, TurboQuantBlock) and block.packed_signs is not None
        assert block.residual_norms is not None
        dim = block.shape[-1]
        signs = unpack_code_tensor(block.packed_signs, 1, block.numel).view(block.shape).float() * 2 - 1
        sketch = _qjl_matrix(dim, block.seed, signs.device)
        correction = math.sqrt(math.pi / 2) / dim * block.residual_norms.float()[..., None] * (signs @ sketch)
        return _dequantize_mse(block) + correction

    def quantize_values(self, values: torch.Tensor, layer_idx: int) -> TurboQuantBlock:
        return _quantize_mse(values, self.bits, self._seed(layer_idx, "values"))[0]

    def dequantize_values(self, block: QuantizedBlock) -> torch.Tensor:
        assert isinstance(block, TurboQuantBlock)
        return _dequantize_mse(block)

    def _seed(self, layer_idx: int, kind: str) -> int:
        return (self.seed * 1_000_003 + layer_idx * 2 + (kind == "values")) % (2**63)


def _quantize_mse(vectors: torch.Tensor, bits: int, seed: int) -> tuple[TurboQuantBlock, torch.Tensor]:
    """Norm + rotated Lloyd-Max codes of [H, n, D] vectors; also returns the float32 reconstruction."""
    dim = vectors.shape[-1]
    exact_norms = vectors.float().norm(dim=-1)
    norms = exact_norms.to(torch.float16)
    unit = vectors.float() / exact_norms.clamp_min(1e-30)[..., None]
    rotated = unit @ rotation_matrix(dim, seed, vectors.device).T
    boundaries, _ = _codebook_tensors(dim, bits, vectors.device)
    codes = torch.bucketize(rotated, boundaries)
    block = TurboQuantBlock(pack_code_tensor(codes, bits), norms, tuple(vectors.shape), bits, seed)  # type: ignore[arg-type]
    return block, _dequantize_mse(block)


def _dequantize_mse(block: TurboQuantBlock) -> torch.Tensor:
    dim = block.shape[-1]
    device = block.packed.device
    _, centroids = _codebook_tensors(dim, block.code_bits, device)
    codes = unpack_code_tensor(block.packed, block.code_bits, block.numel).view(block.shape).long()
    rotated = centroids[codes]
    return (rotated @ rotation_matrix(dim, block.seed, device)) * block.norms.float()[..., None]


@functools.lru_cache(maxsize=256)
def rotation_matrix(dim: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[D, D] float32 random orthogonal matrix: randomized Hadamard for powers of two, else QR of a Gaussian.

    Built on the CPU from the seed (the same matrix on every device), then cached per device.
    """
    if torch.device(device).type != "cpu":
        return rotation_matrix(dim, seed).to(device)
    generator = torch.Generator().manual_seed(seed)
    if dim & (dim - 1) == 0:
        hadamard = torch.ones(1, 1)
        while hadamard.shape[0] < dim:
            hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
        signs = torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1
        return hadamard * signs[None, :] / math.sqrt(dim)
    gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))[None, :]).float()


@functools.lru_cache(maxsize=256)
def _qjl_matrix(dim: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed ^ 0x5EED)
    return torch.randn(dim, dim, generator=generator).to(device)


@functools.lru_cache(maxsize=64)
def _codebook_tensors(dim: int, bits: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """`lloyd_max_codebook` as float32 tensors on `device` (boundaries [2**bits - 1], centroids [2**bits])."""
    boundaries, centroids = lloyd_max_codebook(dim, bits)
    return torch.from_numpy(boundaries).float().to(device), torch.from_numpy(centroids).float().to(device)


@functools.lru_cache(maxsize=64)
def lloyd_max_codebook(
    dim: int, bits: int, grid_size: int = 20001, iterations: int = 300
) -> tuple[np.ndarray, np.ndarray]:
    """Optimal scalar quantizer for one coordinate of a uniformly random unit vector in R^dim.

    The coordinate's density is proportional to (1 - t^2)^((dim - 3) / 2) on [-1, 1]; Lloyd's
    algorithm on a fine grid gives the centroids minimizing mean squared error.

    Returns:
        (boundaries [2**bits - 1], centroids [2**bits]) as float64 arrays, ascending.
    """
    grid = np.linspace(-1.0, 1.0, grid_size + 2)[1:-1]
    density = np.exp((dim - 3) / 2 * np.log1p(-grid * grid))
    density /= density.sum()
    cumulative = np.cumsum(density)
    levels = 2**bits
    centroids = np.interp((np.arange(levels) + 0.5) / levels, cumulative, grid)
    for _ in range(iterations):
        boundaries = (centroids[1:] + centroids[:-1]) / 2
        cell = np.searchsorted(boundaries, grid)
        mass = np.bincount(cell, weights=density, minlength=levels)
        moment = np.bincount(cell, weights=density * grid, minlength=levels)
        centroids = np.where(mass > 0, moment / np.maximum(mass, 1e-300), centroids)
    return (centroids[1:] + centroids[:-1]) / 2, centroids
