"""Asymmetric min-max quantization in groups along one axis, as pure functions.

KIVI's scheme: keys are quantized per channel (groups run along the token axis), values per token
(groups run along the channel axis). A group of `group_size` elements stores a zero point (its
minimum) and a scale; element `x` becomes `round((x - zero) / scale)` in `[0, 2**bits - 1]`.

Zero points and scales are stored in a metadata dtype (the input's, usually fp16). They are rounded
outward before the codes are computed (zero down, scale up), so the stored pair still spans the
group and every element is within `scale / 2` of its dequantized value, the bound `error_bound`
returns.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

KEY_AXIS = -2
VALUE_AXIS = -1
BITS = (2, 3, 4, 8)


@dataclasses.dataclass(frozen=True)
class QuantizedGroups:
    """Codes and per-group parameters of one quantized tensor.

    Attributes:
        codes: uint8, the input's shape, each in `[0, 2**bits - 1]`.
        zeros: Group minima rounded down; the input's shape with `axis` replaced by the group count.
        scales: Group step sizes rounded up; same shape and dtype as `zeros`.
        bits: Bits per code.
        axis: The grouped axis (non-negative).
        group_size: Elements per group along `axis` (the last group may be shorter).
    """

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    bits: int
    axis: int
    group_size: int


def kv_axis(kind: Literal["keys", "values"]) -> int:
    """The grouped axis: tokens for keys (per-channel quantization), channels for values (per-token)."""
    return KEY_AXIS if kind == "keys" else VALUE_AXIS


def quantize(
    x: torch.Tensor, bits: int, axis: int, group_size: int, meta_dtype: torch.dtype | None = None
) -> QuantizedGroups:
    """Quantize `x` in groups of `group_size` consecutive elements along `axis`.

    Args:
        x: Finite floats of any shape.
        bits: Bits per code, one of 2, 3, 4, 8.
        axis: Axis the groups run along.
        group_size: Elements per group (at least 1).
        meta_dtype: Dtype of zeros and scales; defaults to `x.dtype`.

    Raises:
        ValueError: Bad `bits` or `group_size`, non-finite input, or a range the metadata dtype cannot hold.
    """
    if bits not in BITS:
        raise ValueError(f"bits must be one of {list(BITS)}, got {bits}")
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    require_finite(x, "quantization needs finite inputs (found NaN or inf)")
    axis = axis % x.dim()
    meta_dtype = meta_dtype or x.dtype
    groups, length = _grouped(x.float().movedim(axis, -1), group_size)
    if groups.numel() == 0:
        zeros = torch.zeros(groups.shape[:-1], dtype=meta_dtype)
        scales = torch.zeros_like(zeros)
    else:
        zeros = _round_toward(groups.amin(dim=-1), meta_dtype, down=True)
        scales = _round_toward((groups.amax(dim=-1) - zeros.float()) / (2**bits - 1), meta_dtype, down=False)
    require_finite(scales, f"a group's range does not fit in {meta_dtype}")
    safe_scales = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
    codes = torch.round((groups - zeros.float()[..., None]) / safe_scales[..., None]).clamp_(0, 2**bits - 1)
    codes_flat = codes.to(torch.uint8).flatten(-2)[..., :length]
    return QuantizedGroups(
        codes=codes_flat.movedim(-1, axis).contiguous(),
        zeros=zeros.movedim(-1, axis).contiguous(),
        scales=scales.movedim(-1, axis).contiguous(),
        bits=bits,
        axis=axis,
        group_size=group_size,
    )


def dequantize(quantized: QuantizedGroups, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`zero + code * scale` of every element (computed in fp32), cast to `dtype`; the input's shape."""
    codes, length = _split_groups(quantized.codes.float(), quantized.axis, quantized.group_size)
    grouped = torch.addcmul(
        quantized.zeros.float().unsqueeze(quantized.axis + 1),
        codes,
        quantized.scales.float().unsqueeze(quantized.axis + 1),
    )
    return grouped.flatten(quantized.axis, quantized.axis + 1).narrow(quantized.axis, 0, length).to(dtype)


def error_bound(quantized: QuantizedGroups) -> torch.Tensor:
    """`scale / 2` of each element's group: the most any element moved (fp32, the input's shape)."""
    length = quantized.codes.shape[quantized.axis]
    group_size = min(quantized.group_size, max(length, 1))
    expanded = quantized.scales.float().repeat_interleave(group_size, dim=quantized.axis)
    return expanded.narrow(quantized.axis, 0, length) / 2


def num_groups(length: int, group_size: int) -> int:
    return math.ceil(length / group_size)


def _split_groups(values: torch.Tensor, axis: int, group_size: int) -> tuple[torch.Tensor, int]:
    """`values` with `axis` split into `[G, group_size]` (zero-padded at the end), and the axis length."""
    length = values.shape[axis]
    group_size = min(group_size, max(length, 1))
    padding = num_groups(length, group_size) * group_size - length
    if padding:
        shape = list(values.shape)
        shape[axis] = padding
        values = torch.cat([values, values.new_zeros(shape)], dim=axis)
    return values.unflatten(axis, (-1, group_size)) if values.shape[axis] else \
        values.unflatten(axis, (0, group_size)), length


def _grouped(moved: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """`[..., G, group_size]` groups of the last axis, the last group padded with its final element."""
    length = moved.shape[-1]
    # A group longer than the axis is the whole axis; padding it would only cost memory.
    group_size = min(group_size, max(length, 1))
    count = num_groups(length, group_size)
    padding = count * group_size - length
    if padding and length:
        moved = torch.cat([moved, moved[..., -1:].expand(*moved.shape[:-1], padding)], dim=-1)
    if length == 0:
        return moved.new_zeros((*moved.shape[:-1], 0, group_size)), 0
    return moved.reshape(*moved.shape[:-1], count, group_size), length


def _round_toward(values: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """`values` (fp32) in `dtype`, rounded down (or up) so the result never lies above (below) them."""
    rounded = values.to(dtype)
    if dtype == torch.float32:
        return rounded
    direction = torch.full_like(rounded, -math.inf if down else math.inf)
    wrong_side = rounded.float() > values if down else rounded.float() < values
    return torch.where(wrong_side, torch.nextafter(rounded, direction), rounded)


def require_finite(tensor: torch.Tensor, message: str) -> None:
    """Raise `ValueError(message)` when `tensor` holds NaN or inf, without a device round trip.

    On the CPU the check is a plain read. On CUDA it is queued on the device (`torch._assert_async`),
    so it fails the stream instead of stalling it to bring a flag back; on devices without values
    (meta) there is nothing to check.
    """
    if tensor.device.type == "cpu":
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(message)
    elif tensor.device.type == "cuda":
        torch._assert_async(torch.isfinite(tensor).all(), message)
