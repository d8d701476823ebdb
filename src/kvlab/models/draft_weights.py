"""Cheaper copies of a model's weights for drafting (only the verifier has to be exact).

On a CPU a decode step of a small model is bound by reading its weights, so a draft step that reads
int8 weights (a quarter of float32) is several times cheaper; int4 weights read an eighth, plus a
scale and a zero per group of 64 (their speed is not measured yet). The copy is made once per loaded
model: a deep copy in bf16, or one whose linear layers are replaced by quantized ones. The LM head is
quantized too, even where the model ties it to the embeddings: the copy's embedding keeps the float
weight (a lookup reads a few rows of it), while the head reads every row.
"""

from __future__ import annotations

import copy
import logging
import warnings
import weakref
from typing import Literal

import torch
from transformers import PreTrainedModel

from kvlab.errors import ConfigError
from kvlab.models.compiled_forward import compile_forward, is_compiled
from kvlab.models.decoder_forward import fuse_projections
from kvlab.models.int4_linear import int4_kernels_available, quantize_linear_layers
from kvlab.models.packed_linear import dense_copy

DraftWeights = Literal["same", "bf16", "int8", "int4"]
DRAFT_WEIGHTS: tuple[DraftWeights, ...] = ("same", "bf16", "int8", "int4")

logger = logging.getLogger(__name__)

# Keyed weakly by the original model, so a copy lives exactly as long as the model it was made from.
_copies: dict[str, weakref.WeakKeyDictionary[PreTrainedModel, PreTrainedModel]] = {
    "bf16": weakref.WeakKeyDictionary(),
    "int8": weakref.WeakKeyDictionary(),
    "int4": weakref.WeakKeyDictionary(),
}


def draft_model(model: PreTrainedModel, weights: DraftWeights) -> PreTrainedModel:
    """The model the drafter decodes with: `model` itself, or a cached bf16-, int8- or int4-weight copy of it.

    A bf16 copy computes in bf16 and hands back keys/values that the draft cache stores in its own
    dtype; an int4 copy computes its linear layers in float32 and hands back the dtype it was given.
    Only drafting uses a copy, so output stays the exact model's.

    Raises:
        ConfigError: int8 or int4 weights were asked for on a device or torch build without their CPU
            kernels, or int4 weights for a model none of whose linear layers the int4 kernel can take.
    """
    if weights == "same":
        return model
    if weights not in DRAFT_WEIGHTS:
        raise ConfigError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {weights!r}")
    copies = _copies[weights]
    if model not in copies:
        duplicate = _COPY_MAKERS[weights](model)
        if duplicate is not model and is_compiled(model):
            # A copy carries the original's compiled forward, whose graph holds the original's weights as
            # constants: it gets its own where its layers allow (bf16 and int4 copies), else the eager one.
            compile_forward(duplicate)
        copies[model] = duplicate
    return copies[model]


def _bf16_copy(model: PreTrainedModel) -> PreTrainedModel:
    if next(model.parameters()).dtype == torch.bfloat16:
        return model
    duplicate = copy.deepcopy(model)
    duplicate.bfloat16()  # packed layers pack their bf16 weights again (`PackedLinear._apply`)
    return duplicate


def _int8_copy(model: PreTrainedModel) -> PreTrainedModel:
    if next(model.parameters()).device.type != "cpu":
        raise ConfigError("int8 draft weights use CPU kernels; on a GPU use draft weights 'same'")
    quantization = getattr(torch.ao, "quantization", None)
    if quantization is None or not hasattr(quantization, "quantize_dynamic"):
        raise ConfigError("this torch build has no dynamic int8 quantization; use draft weights 'same'")
    with warnings.catch_warnings():
        # Eager dynamic quantization is deprecated upstream but still ships, with fast fbgemm kernels.
        warnings.simplefilter("ignore")
        # Unfused: dynamic quantization scales each weight by its largest value, and one scale over q, k
        # and v measured layer 0's values 0.090 off the float model's (of their largest) against 0.034.
        quantized: PreTrainedModel = quantization.quantize_dynamic(
            dense_copy(model), {torch.nn.Linear}, dtype=torch.qint8
        )
    return quantized


def _int4_copy(model: PreTrainedModel) -> PreTrainedModel:
    device = next(model.parameters()).device
    if not int4_kernels_available(device):
        raise ConfigError(
            f"int4 draft weights use PyTorch's CPU int4 kernels, which this model ({device}) or this torch "
            f"build ({torch.__version__}) lacks; use draft weights 'int8' or 'same'"
        )
    duplicate = _fused_dense_copy(model)
    num_linears = sum(type(module) is torch.nn.Linear for module in duplicate.modules())
    left_in_float = quantize_linear_layers(duplicate)
    if len(left_in_float) == num_linears:
        raise ConfigError("no linear layer of this model has a shape the int4 kernel takes "
                          "(kvlab.models.int4_linear); use draft weights 'int8'")
    if left_in_float:
        logger.warning("int4 draft weights: %d linear layers keep float weights (the int4 kernel cannot take "
                       "their shapes): %s", len(left_in_float), ", ".join(left_in_float))
    return duplicate


def _fused_dense_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A float copy with plain `torch.nn.Linear` layers, each layer's q/k/v and gate/up projections fused
    where kvlab's lean forward runs (`kvlab.models.decoder_forward`): quantized to int4 next (scales per
    row and group of 64 inputs, so fusing changes no code), a draft step then reads each fused weight in
    one product (measured on SmolLM2: 8.8 ms a step against 10.1 unfused)."""
    duplicate: PreTrainedModel = dense_copy(model)  # type: ignore[assignment]
    fuse_projections(duplicate)
    return duplicate


_COPY_MAKERS = {"bf16": _bf16_copy, "int8": _int8_copy, "int4": _int4_copy}
