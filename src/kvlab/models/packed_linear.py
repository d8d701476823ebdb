"""Linear layers whose weights oneDNN reorders once into its blocked layout (CPU, float32 or bfloat16).

A decode step of a small model on a CPU is bound by reading its weights, and oneDNN's prepacked
`_linear_pointwise` reads them faster than `F.linear` over a row-major `[out, in]` weight, most of all
for the 2 to 9 rows of a verify: `benchmarks/step_costs.py` prints a plain step and a verify with both.
The sums are the same float32 sums in another order, so logits differ from `F.linear`'s in their last
bits (relative 1e-6); kvlab's own equality claims
(lossless, prefix reuse, identity compression) compare kvlab with kvlab on the same weights and stay
exact. `load_model(packed_weights=False)` keeps transformers' own layers for bit-identity with them.

`PackedLinear.reference` is the plain-torch path (`F.linear` over the same weight) the tests hold the
kernel to.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def packing_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this torch build can pack linear weights for `device` and `dtype` (oneDNN on a CPU)."""
    if torch.device(device).type != "cpu" or dtype not in PACKABLE_DTYPES:
        return False
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


class PackedLinear(torch.nn.Module):
    """`y = x W^T + b` with `W` held in oneDNN's blocked layout.

    Attributes:
        in_features, out_features: As `torch.nn.Linear`'s.
        packed_weight: The weight reordered by oneDNN (an opaque mkldnn tensor, not a parameter:
            nothing trains it and `state_dict` carries the dense form, see `_save_to_state_dict`).
        bias: [out_features] or None.
        tied: The dense weight is also a parameter of another module (an LM head tied to the
            embeddings), which carries it in `named_parameters` and in the model's identity.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tied: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.tied = tied
        self.packed_weight = _pack(weight.detach())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, tied: bool = False) -> PackedLinear:
        return cls(linear.weight, linear.bias, tied)

    @property
    def weight(self) -> torch.Tensor:
        """The dense [out_features, in_features] weight (a fresh copy, bit-equal to the original)."""
        return self.packed_weight.to_dense()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(inputs, self.packed_weight, self.bias, "none", [None], "")

    def reference(self, inputs: torch.Tensor) -> torch.Tensor:
        """The same product through `F.linear` (the path this one is tested against)."""
        return F.linear(inputs, self.weight, self.bias)

    def to_linear(self) -> torch.nn.Linear:
        """A plain `torch.nn.Linear` with the same weight and bias."""
        weight = self.weight
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=weight.dtype)
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = torch.nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        # An mkldnn tensor has no storage to copy; a copy packs the dense weight again.
        duplicate = PackedLinear(self.weight, None if self.bias is None else self.bias.detach().clone(), self.tied)
        duplicate.train(self.training)
        memo[id(self)] = duplicate
        return duplicate

    def _apply(self, fn: Any, recurse: bool = True) -> PackedLinear:
        # `.to()`, `.bfloat16()` and friends act on the dense weight, then pack it again when the result
        # is still packable; a move off the CPU (or to float16) cannot be packed and is refused.
        weight = fn(self.weight)
        if weight.dtype == self.packed_weight.dtype and weight.device == self.packed_weight.device:
            return self
        if not packing_available(weight.device, weight.dtype):
            raise RuntimeError(
                f"packed linear weights live on the CPU in {PACKABLE_DTYPES}; unpack the model first "
                "(kvlab.models.packed_linear.unpack_linear_layers) to move it to "
                f"{weight.device} / {weight.dtype}"
            )
        self.packed_weight = _pack(weight)
        if self.bias is not None:
            self.bias = torch.nn.Parameter(fn(self.bias.detach()), requires_grad=False)
        return self

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()


class FusedPackedLinear(PackedLinear):
    """Several bias-free projections of one input packed as one weight (q, k and v; gate and up), so a
    forward reads them in one product. The parts stay where they were as `ProjectionSlice`s, which carry
    their names in the state dict and the model's identity; this layer carries nothing there."""

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        pass  # the parts save their own weights, under the names the unfused model gives them

    def __deepcopy__(self, memo: dict[int, Any]) -> FusedPackedLinear:
        duplicate = FusedPackedLinear(self.weight, None)
        duplicate.train(self.training)
        memo[id(self)] = duplicate
        return duplicate


class ProjectionSlice(torch.nn.Module):
    """Output features [start, start + out_features) of the fused projection `owner.<fused_name>`,
    standing where that part's own layer stood. transformers' forward calls it (the fused product, of
    which it keeps its features); kvlab's lean forward calls the fused layer once for all its parts. It
    holds no weight: the fused layer is looked up on each call, so quantizing or packing that layer
    in place (draft copies) carries the part along."""

    owner: torch.nn.Module

    def __init__(self, owner: torch.nn.Module, fused_name: str, start: int, out_features: int, in_features: int):
        super().__init__()
        object.__setattr__(self, "owner", owner)  # a reference, not a submodule: the fused layer is owner's child
        self.fused_name, self.start = fused_name, start
        self.out_features, self.in_features = out_features, in_features
        self.bias = None

    @property
    def fused(self) -> torch.nn.Module:
        return getattr(self.owner, self.fused_name)  # type: ignore[no-any-return]

    @property
    def weight(self) -> torch.Tensor:
        """This part's rows of the fused layer's dense weight (AttributeError where the fused layer holds
        none: int8 and int4 draft copies)."""
        weight = getattr(self.fused, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise AttributeError(f"{self.fused_name} ({type(self.fused).__name__}) holds no dense weight")
        return weight[self.start : self.start + self.out_features]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.fused(inputs)[..., self.start : self.start + self.out_features]

    def to_linear(self) -> torch.nn.Linear:
        weight = self.weight
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=False, dtype=weight.dtype)
        linear.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
        return linear

    def extra_repr(self) -> str:
        return f"features {self.start}..{self.start + self.out_features} of {self.fused_name}"

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight


def fuse_parts(parent: torch.nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    """Make `parent`'s bias-free linear layers `names` (all `PackedLinear`, then one `FusedPackedLinear`, or
    all `torch.nn.Linear`, then one `torch.nn.Linear`, of one input size and dtype) one layer at
    `parent.<fused_name>`, each part replaced by its `ProjectionSlice`. Returns whether it did (False,
    and nothing changed, when the parts are not such layers)."""
    parts: list[Any] = [getattr(parent, name, None) for name in names]
    kinds = {type(part) for part in parts}
    if len(kinds) != 1 or kinds.pop() not in (PackedLinear, torch.nn.Linear):
        return False
    if any(part.bias is not None or getattr(part, "tied", False) for part in parts):
        return False
    if len({(part.in_features, part.weight.dtype, part.weight.device) for part in parts}) != 1:
        return False
    weight = torch.cat([part.weight.detach() for part in parts])
    if isinstance(parts[0], PackedLinear):
        fused: torch.nn.Module = FusedPackedLinear(weight, None)
    else:
        fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
        fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    setattr(parent, fused_name, fused)
    start = 0
    for name, part in zip(names, parts, strict=True):
        setattr(parent, name, ProjectionSlice(parent, fused_name, start, part.out_features, part.in_features))
        start += part.out_features
    return True


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Replace every `torch.nn.Linear` in `model` by a `PackedLinear` with the same weights, in place.

    A weight tied to another module (an LM head tied to the embeddings) is packed as a copy; the
    embedding keeps the dense original. Returns how many layers were packed; 0 (and nothing changed)
    when this torch build or the model's device and dtype cannot be packed.
    """
    linears = _children(model, torch.nn.Linear)
    if not linears or not packing_available(linears[0][2].weight.device, linears[0][2].weight.dtype):
        return 0
    others = {id(parameter) for module in model.modules() if type(module) is not torch.nn.Linear
              for parameter in module.parameters(recurse=False)}
    with torch.no_grad():
        for parent, name, child in linears:
            setattr(parent, name, PackedLinear.from_linear(child, tied=id(child.weight) in others))
    return len(linears)


def is_packed(model: torch.nn.Module) -> bool:
    """Whether any linear layer of `model` runs through packed weights."""
    return any(isinstance(module, PackedLinear) for module in model.modules())


def packed_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, packed weight) of every packed layer whose weight no parameter carries, named as
    `named_parameters` names an unpacked layer's ("model.layers.0.mlp.up_proj.weight"). The tensors
    are oneDNN's opaque ones (`.to_dense()` gives the values); each has the dense weight's shape."""
    return [(f"{name}.weight", module.weight if isinstance(module, ProjectionSlice) else module.packed_weight)
            for name, module in model.named_modules()
            if isinstance(module, ProjectionSlice) or (isinstance(module, PackedLinear) and not module.tied
                                                       and not isinstance(module, FusedPackedLinear))]


def unpack_linear_layers(model: torch.nn.Module) -> int:
    """Replace every `PackedLinear` in `model` by a plain `torch.nn.Linear`, in place, and every fused
    projection by its parts (`torch.nn.Linear`s again, the fused layers removed); returns how many
    layers it replaced."""
    parts = _children(model, ProjectionSlice)
    fused = {(id(part.owner), part.fused_name): part.owner for _, _, part in parts}
    for parent, name, part in parts:
        setattr(parent, name, part.to_linear())
    for (_, fused_name), owner in fused.items():
        delattr(owner, fused_name)
    packed = _children(model, PackedLinear)
    for parent, name, child in packed:
        setattr(parent, name, child.to_linear())
    return len(packed) + len(parts)


def dense_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` with plain `torch.nn.Linear` layers (what other kernels, such as dynamic
    int8 quantization, expect to find)."""
    duplicate = copy.deepcopy(model)
    unpack_linear_layers(duplicate)
    return duplicate


def _pack(weight: torch.Tensor) -> torch.Tensor:
    # The batch-size hint picks oneDNN's blocking; 16 measured fastest from 1 to 4096 rows here.
    return torch.ops.mkldnn._reorder_linear_weight(weight, 16)


def _children(model: torch.nn.Module, kind: type[ModuleT]) -> list[tuple[torch.nn.Module, str, ModuleT]]:
    """(parent, attribute name, child) of every submodule of exactly type `kind` (a subclass of
    `torch.nn.Linear`, such as a quantized one, is not a plain linear layer), for replacing it in place."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is kind]
