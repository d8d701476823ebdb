"""Pack integer codes of any width 1..8 bits densely into bytes, and back (pure functions)."""

from __future__ import annotations

import numpy as np
import torch


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes in [0, 2**bits) into a flat uint8 tensor of ceil(numel * bits / 8) bytes.

    Args:
        codes: Integer tensor of any shape; values must fit in `bits`.
        bits: 1..8.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    flat = codes.reshape(-1).to(torch.uint8).cpu().numpy()
    if bits == 8:
        return torch.from_numpy(flat.copy())
    # Each code becomes `bits` bits, most significant first, then the bit stream is packed.
    bit_planes = np.unpackbits(flat[:, None], axis=1)[:, 8 - bits :]
    return torch.from_numpy(np.packbits(bit_planes.reshape(-1)))


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of `pack_codes`: a flat uint8 tensor of `numel` codes."""
    data = packed.cpu().numpy()
    if bits == 8:
        return torch.from_numpy(data[:numel].copy())
    bit_stream = np.unpackbits(data)[: numel * bits].reshape(numel, bits)
    padded = np.zeros((numel, 8), dtype=np.uint8)
    padded[:, 8 - bits :] = bit_stream
    return torch.from_numpy(np.packbits(padded, axis=1).reshape(-1))


def packed_nbytes(numel: int, bits: int) -> int:
    return (numel * bits + 7) // 8
