"""Linear layers with groupwise 4-bit weights, multiplied by PyTorch's CPU int4 kernel (for drafts).

A decode step of a small model on a CPU is bound by reading its linear weights; 4-bit codes read an
eighth of float32's bytes, plus 4 bytes of scale and mid per group of 64 weights. Each weight moves
by up to half a quantization step, so only a draft uses them: verification stays on the exact model
(`kvlab.models.draft_weights`), and the output does not change.

Quantization (`quantize_int4`) is asymmetric per group of `group_size` consecutive input features of
one output row: `weight ~= code * scale + zero`, codes 0..15, `zero` the group's minimum and `scale`
its range / 15. `int4_linear_reference` multiplies by the dequantized weights in plain torch;
`Int4Linear` computes the same product with `torch.ops.aten._weight_int4pack_mm_for_cpu` over weights
packed once by `_convert_weight_to_int4pack_for_cpu`, in tinygemm's convention (`(code - 8) * scale +
mid`, `mid = zero + 8 * scale`), and is tested against the reference.

What the CPU kernel takes (torch 2.13, checked by `int4_shape_problems`): out_features a multiple of
16; a group size of 32, 64, 128 or 256 that divides in_features; float32, bfloat16 or float16 inputs
with scales of the same dtype (kvlab computes in bfloat16, the kernel's fast path, and hands back its
input's dtype). A layer outside
these shapes stays a float `torch.nn.Linear` in `quantize_linear_layers`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvlab.errors import ConfigError

DEFAULT_GROUP_SIZE = 64
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
OUT_FEATURES_MULTIPLE = 16
# The CPU packing ignores it (the layout is [N, K / 2] bytes for 1, 2, 4 or 8) but still takes one.
INNER_K_TILES = 2
# What the kernel computes in: its bfloat16 path is the vectorized one (see `Int4Linear`).
COMPUTE_DTYPE = torch.bfloat16
_MAX_CODE = 15
_MID_CODE = 8


class Int4Weights(NamedTuple):
    """A weight quantized by `quantize_int4`: `weight ~= codes * scales + zeros`, group by group.

    Attributes:
        codes: [out_features, in_features] uint8, values 0..15.
        scales: [out_features, in_features / group_size] float32, each group's range / 15 (1 where the
            group is constant, so that no scale is zero).
        zeros: [out_features, in_features / group_size] float32, each group's minimum.
        group_size: Consecutive input features that share a scale and a zero.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Weights:
    """Groupwise asymmetric 4-bit codes of `weight` ([out_features, in_features], any float dtype).

    Each weight lands within `scale / 2` of its dequantized value (`dequantize_int4`).

    Raises:
        ConfigError: `group_size` does not divide in_features.
    """
    out_features, in_features = weight.shape
    if group_size <= 0 or in_features % group_size:
        raise ConfigError(f"group size {group_size} must divide in_features {in_features}")
    groups = weight.detach().to(torch.float32).reshape(out_features, in_features // group_size, group_size)
    zeros = groups.amin(dim=-1)
    scales = (groups.amax(dim=-1) - zeros) / _MAX_CODE
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: every code is 0
    codes = ((groups - zeros[..., None]) / scales[..., None]).round_().clamp_(0, _MAX_CODE)
    return Int4Weights(codes.to(torch.uint8).reshape(out_features, in_features), scales, zeros, group_size)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 [out_features, in_features] weight that `quantize_int4`'s codes, scales and zeros stand for."""
    out_features, in_features = codes.shape
    groups = codes.reshape(out_features, in_features // group_size, group_size).to(torch.float32)
    return (groups * scales[..., None] + zeros[..., None]).reshape(out_features, in_features)


def int4_linear_reference(inputs: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`inputs @ W^T + bias` with `W` the dequantized weight, in plain float32 torch (`Int4Linear`'s reference).

    Args:
        inputs: [..., in_features], any float dtype (the product is taken in float32).
        codes, scales, zeros, group_size: As `Int4Weights`'.
        bias: [out_features] or None.

    Returns:
        [..., out_features] in the dtype of `inputs`.
    """
    weight = dequantize_int4(codes, scales, zeros, group_size)
    outputs = F.linear(inputs.to(torch.float32), weight, None if bias is None else bias.to(torch.float32))
    return outputs.to(inputs.dtype)


def int4_kernels_available(device: torch.device | str) -> bool:
    """Whether this torch build can pack and multiply int4 weights on `device` (its CPU kernels only)."""
    return (torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def choose_group_size(in_features: int) -> int:
    """`DEFAULT_GROUP_SIZE` when it divides `in_features`, else the largest smaller kernel group size that
    does, else `DEFAULT_GROUP_SIZE` (which `int4_shape_problems` then reports)."""
    smaller = [size for size in KERNEL_GROUP_SIZES if size <= DEFAULT_GROUP_SIZE]
    return next((size for size in reversed(smaller) if in_features % size == 0), DEFAULT_GROUP_SIZE)


def int4_shape_problems(out_features: int, in_features: int, group_size: int) -> list[str]:
    """What keeps a [out_features, in_features] weight in groups of `group_size` from the CPU int4
    kernel, one sentence each (empty when it fits)."""
    problems = []
    if out_features % OUT_FEATURES_MULTIPLE:
        problems.append(f"out_features must be a multiple of {OUT_FEATURES_MULTIPLE}, got {out_features}")
    if group_size not in KERNEL_GROUP_SIZES:
        problems.append(f"the group size must be one of {', '.join(map(str, KERNEL_GROUP_SIZES))}, got {group_size}")
    if in_features % group_size:
        problems.append(f"the group size ({group_size}) must divide in_features, got {in_features}")
    return problems


class Int4Linear(torch.nn.Module):
    """`y = x W^T + b` with `W` held as packed 4-bit codes and per-group scales and zeros (CPU only).

    Attributes:
        in_features, out_features: As `torch.nn.Linear`'s.
        group_size: Input features per scale and zero.
        packed_weight: [out_features, in_features / 2] uint8, the codes in the CPU kernel's layout.
        scales_and_zeros: [in_features / group_size, out_features, 2] bfloat16: each group's scale and
            the value of code 8 (tinygemm's convention). The kernel computes in its inputs' dtype, which
            must be the scales': its float32 path is a slow fallback (678 us against 24 us in bfloat16 for
            a [1536, 576] weight and one row on 2 cores of an EPYC, where float32's own linear takes 55 us).
        bias: [out_features] float32, or None.
    """

    packed_weight: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int | None = None) -> None:
        """Quantize and pack `weight` ([out_features, in_features], on the CPU) once.

        Raises:
            ConfigError: The CPU int4 kernel cannot take this shape or group size (the message lists
                what it needs), or `weight` is not on the CPU.
        """
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size = choose_group_size(self.in_features) if group_size is None else group_size
        problems = int4_shape_problems(self.out_features, self.in_features, self.group_size)
        if problems:
            raise ConfigError(f"cannot pack a [{self.out_features}, {self.in_features}] linear weight into int4: "
                              + "; ".join(problems))
        if weight.device.type != "cpu":
            raise ConfigError(f"int4 linear layers use CPU kernels; the weight is on {weight.device}")
        codes, scales, zeros, _ = quantize_int4(weight, self.group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), INNER_K_TILES)
        self.register_buffer("packed_weight", packed)
        mids = zeros + _MID_CODE * scales
        scales_and_zeros = torch.stack([scales, mids], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(COMPUTE_DTYPE))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int | None = None) -> Int4Linear:
        return cls(linear.weight, linear.bias, group_size)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        # The kernel takes a contiguous 2D input in the scales' dtype (bfloat16: its fast path).
        rows = inputs.reshape(-1, self.in_features).to(COMPUTE_DTYPE).contiguous()
        outputs = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed_weight, self.group_size,
                                                             self.scales_and_zeros).to(torch.float32)
        if self.bias is not None:
            outputs += self.bias
        return outputs.reshape(*inputs.shape[:-1], self.out_features).to(inputs.dtype)

    def weight_nbytes(self) -> int:
        """Bytes of weight a forward reads: the packed codes and the scales and zeros (not the bias)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in (self.packed_weight, self.scales_and_zeros))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")


def quantize_linear_layers(model: torch.nn.Module, group_size: int | None = None) -> list[str]:
    """Replace every `torch.nn.Linear` of `model` that the CPU int4 kernel can take by an `Int4Linear`, in
    place; a layer it cannot take (`int4_shape_problems`) stays a float `torch.nn.Linear`.

    Returns:
        The names (as `named_modules` gives them) of the linear layers left in float.
    """
    left_in_float = []
    linears = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    with torch.no_grad():
        for name, linear in linears:
            size = choose_group_size(linear.in_features) if group_size is None else group_size
            if int4_shape_problems(linear.out_features, linear.in_features, size):
                left_in_float.append(name)
                continue
            parent_name, _, child_name = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child_name, Int4Linear.from_linear(linear, size))
    return left_in_float
