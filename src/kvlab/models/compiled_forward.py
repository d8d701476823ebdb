"""The lean forward compiled as one graph by `torch.compile` (Inductor), attention left to the cache.

A decode step of a small model on a CPU pays for each of its few hundred small operations: SmolLM2-135M
at a 16-token context, 2 threads, spends about 9 ms of a 37 ms step outside its matrix products (norms,
rotary, residuals, views: Python and dispatch, not arithmetic), and an int4-weight draft step, whose
products take 7 ms, is mostly that work. Compiled, the norms, rotary and residuals become a few fused C++
loops called from a C++ wrapper, and Inductor packs the float weights for oneDNN itself (freezing).
Measured on the embedded model, one process, interleaved (`benchmarks/roofline.py --with-compiled-forward`,
docs/performance.md): the weights-only step 37.3 ms eager against 29.9 compiled, the plain step at 8064
tokens 60.0 against 53.2, an int4 draft step there 20.1 against 15.2.

Attention stays kvlab's: each layer calls the opaque operator `kvlab::attend`, which hands its queries,
keys and values to the step of the forward in flight (`ForwardStep`, `PackedStep`: any cache, any
layer kind, compressed or tiered), so one graph serves plain steps, drafts, verifies and prefill
pieces. In a one-row forward (every packed forward of the engine) token counts are unbacked sizes: one
graph for every count, no recompiling as a packed batch or a verify changes size.

The cost is compiling: 30 to 75 s on the first forward of each model (each draft weight set is its own
model) on 2 CPU cores. Logits differ from the eager forward's in their last bits (Inductor sums a norm
in another order; 5e-5 at most on the embedded model's next-token logits in a scratch run): greedy
output is compared within one forward kind, and kvlab's equality claims (lossless, prefix reuse)
compare the compiled model with itself. Opt in with `load_model(compile_forward=True)` or
`kvlab generate --compile-forward`.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import PreTrainedModel

from kvlab.models.attention_hook import AttentionStep
from kvlab.models.decoder_forward import COMPILED_FORWARD_ATTRIBUTE, lean_forward, runs_lean
from kvlab.models.int4_linear import Int4Linear
from kvlab.models.packed_linear import is_packed

COMPILABLE_LINEARS = (torch.nn.Linear, Int4Linear)
"""Linear layers the compiled graph takes: float ones (Inductor packs them) and int4 ones (their kernel
is an ATen operator). oneDNN-packed layers hold opaque tensors and int8 dynamic ones script objects,
which the compiler cannot trace: such models keep the eager forward."""

_INDUCTOR_OPTIONS = {
    # Weights become constants: Inductor packs float linear weights for oneDNN once, at compile time.
    "freezing": True,
    # The graph's calls run from generated C++, not a Python wrapper (a scratch run: the weights-only step
    # 33.0 ms with it, 35.1 without, beside eager steps of 38.7 and 40.5 ms).
    "cpp_wrapper": True,
}


class _StepInFlight(threading.local):
    """The step of the compiled forward running on this thread, which `kvlab::attend` hands each layer to."""

    step: AttentionStep | None = None


_in_flight = _StepInFlight()


@torch.library.custom_op("kvlab::attend", mutates_args=())
def _attend_in_flight(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, scaling: float
) -> torch.Tensor:
    step = _in_flight.step
    if step is None:
        raise RuntimeError("kvlab::attend runs only inside a compiled kvlab forward")
    # Inductor reuses a graph buffer once its last reader ran, and a step may keep the new keys and
    # values (captured for a draft cache or a prefix store): it gets copies the graph does not own. The
    # output is copied for the same reason the other way: the graph may write into the buffers it is given.
    output = step.attend(layer_idx, queries, keys.clone(), values.clone(), scaling)
    return output.clone(memory_format=torch.contiguous_format)


@_attend_in_flight.register_fake
def _attend_shape(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, scaling: float
) -> torch.Tensor:
    return queries.new_empty(queries.shape)  # contiguous, as the real one returns it


def _graph_attention(
    layer_idx: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    return torch.ops.kvlab.attend(queries, keys, values, layer_idx, scaling)  # type: ignore[no-any-return]


def _graph(model: PreTrainedModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
           kept: torch.Tensor) -> torch.Tensor:
    return lean_forward(model, input_ids, position_ids, kept, _graph_attention)


class CompiledForward:
    """One model's compiled lean forward, called by `kvlab.models.decoder_forward.causal_lm_forward`.

    Frozen weights are constants of a graph: Dynamo guards each graph on the model it was compiled for,
    so another model compiles its own (tested with two models of different weights). Past torch's
    recompile limit on one function (`torch._dynamo.config.recompile_limit`, 8 by default) a further
    model runs the same Python eagerly, with torch's warning: slower, never wrong.
    """

    def __init__(self) -> None:
        self._compiled = torch.compile(_graph, dynamic=True)

    def __call__(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: int | torch.Tensor,
        step: AttentionStep,
    ) -> torch.Tensor:
        kept = _kept_positions(logits_to_keep, input_ids.shape[1], input_ids.device)
        # Dynamo guards on a tensor's dispatch keys, which differ between tensors made inside and outside
        # inference mode: made alike, a prefill's ids (the caller's) and a step's (made in the forward) share
        # one graph instead of compiling two.
        input_ids, position_ids, kept = (_as_inference(tensor) for tensor in (input_ids, position_ids, kept))
        if input_ids.shape[0] == 1:
            # One row (every packed forward of the engine): token counts as unbacked sizes, one graph from
            # 1 token up. Several rows (the reference decoder, a batched prefill) keep ordinary dynamic sizes:
            # Inductor lays out their products by asking whether a count is 1, which an unbacked size cannot
            # answer (a few more graphs, off the engine's path).
            for tensor, dim in ((input_ids, 1), (position_ids, 1), (kept, 0)):
                torch._dynamo.decorators.mark_unbacked(tensor, dim)
        if _in_flight.step is not None:
            raise RuntimeError("a compiled kvlab forward is already running on this thread")
        _in_flight.step = step
        try:
            # Set around the call, not as `torch.compile` options: freezing given there is not applied
            # (measured: the graph then multiplied unpacked weights, 51 ms a weights-only step against 34).
            with torch._inductor.config.patch(_INDUCTOR_OPTIONS):
                return self._compiled(model, input_ids, position_ids, kept)  # type: ignore[no-any-return]
        finally:
            _in_flight.step = None


def _as_inference(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_inference() or not torch.is_inference_mode_enabled():
        return tensor
    return tensor.clone()


def _kept_positions(logits_to_keep: int | torch.Tensor, num_tokens: int, device: torch.device) -> torch.Tensor:
    if isinstance(logits_to_keep, torch.Tensor):
        return logits_to_keep
    first = 0 if logits_to_keep == 0 else num_tokens - logits_to_keep
    return torch.arange(first, num_tokens, device=device)


def compilable(model: torch.nn.Module) -> bool:
    """Whether `compile_forward` can compile `model`: the lean forward runs it and every linear layer is
    one the graph takes (`COMPILABLE_LINEARS`)."""
    if not runs_lean(model):
        return False
    linears = [module for module in model.modules() if "Linear" in type(module).__name__]
    return all(type(module) in COMPILABLE_LINEARS for module in linears)


def compile_forward(model: torch.nn.Module) -> bool:
    """Make `model`'s kvlab forwards run one compiled graph (compiled on its first forward); returns
    whether it did. A model `compilable` refuses keeps (or goes back to) the eager forward."""
    if not compilable(model):
        uncompile_forward(model)
        return False
    setattr(model, COMPILED_FORWARD_ATTRIBUTE, CompiledForward())
    return True


def uncompile_forward(model: torch.nn.Module) -> None:
    """Back to the eager forward (a copy of a compiled model inherits its compiled forward otherwise)."""
    if COMPILED_FORWARD_ATTRIBUTE in model.__dict__:
        delattr(model, COMPILED_FORWARD_ATTRIBUTE)


def forward_kind(model: Any) -> str:
    """How `model`'s kvlab forward runs, for keying what was timed on it: "compiled", "packed" (oneDNN-packed
    layers, eager) or "eager"."""
    return "compiled" if is_compiled(model) else "packed" if is_packed(model) else "eager"


def is_compiled(model: Any) -> bool:
    """Whether `model`'s kvlab forwards run a compiled graph."""
    return getattr(model, COMPILED_FORWARD_ATTRIBUTE, None) is not None
