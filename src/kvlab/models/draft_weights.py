"""Cheaper copies of a model's weights for drafting (only the verifier has to be exact).

On a CPU a decode step of a small model is bound by reading its weights, so a draft step that reads
int8 weights (a quarter of float32) is several times cheaper. The copy is made once per loaded model
and shares everything but the linear layers.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import Literal

import torch
from transformers import PreTrainedModel

from kvlab.errors import ConfigError
from kvlab.models.packed_linear import dense_copy

DraftWeights = Literal["same", "bf16", "int8"]
DRAFT_WEIGHTS: tuple[DraftWeights, ...] = ("same", "bf16", "int8")

# Keyed weakly by the original model, so a copy lives exactly as long as the model it was made from.
_copies: dict[str, weakref.WeakKeyDictionary[PreTrainedModel, PreTrainedModel]] = {
    "bf16": weakref.WeakKeyDictionary(),
    "int8": weakref.WeakKeyDictionary(),
}


def draft_model(model: PreTrainedModel, weights: DraftWeights) -> PreTrainedModel:
    """The model the drafter decodes with: `model` itself, or a cached bf16- or int8-weight copy of it.

    A bf16 copy computes in bf16 and hands back keys/values that the draft cache stores in its own
    dtype; only drafting uses it, so output stays the exact model's.

    Raises:
        ConfigError: int8 weights were asked for on a device or torch build without int8 CPU kernels.
    """
    if weights == "same":
        return model
    if weights not in DRAFT_WEIGHTS:
        raise ConfigError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {weights!r}")
    copies = _copies[weights]
    if model not in copies:
        copies[model] = _int8_copy(model) if weights == "int8" else _bf16_copy(model)
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
        quantized: PreTrainedModel = quantization.quantize_dynamic(
            dense_copy(model), {torch.nn.Linear}, dtype=torch.qint8
        )
    return quantized
