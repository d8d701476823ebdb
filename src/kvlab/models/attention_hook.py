"""Hands each attention call of a transformers model to kvlab's cache.

kvlab registers an attention implementation named "kvlab" with transformers. A forward that passes
`kvlab_step=...` (see `kvlab.cache.forward`) gets its attention computed by that step, which stores
the new keys/values in kvlab's cache and attends over what the cache holds; the model itself runs
with `use_cache=False` and never sees the cache. Any other call (for example `model.generate`) falls
through to transformers' SDPA path unchanged, so a model prepared by kvlab still behaves as before.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvlab.attention import softcapped_attention

ATTENTION_IMPLEMENTATION = "kvlab"


class AttentionStep(Protocol):
    """What a forward step must provide to own attention (implemented by `kvlab.cache.ForwardStep`)."""

    def attend(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


def _kvlab_attention(  # noqa: PLR0913 - the signature transformers' AttentionInterface calls every attention function with
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    kvlab_step: AttentionStep | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    softcap = kwargs.get("softcap")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if kvlab_step is None:
        if softcap is not None:
            # SDPA has no soft-cap; transformers' own calls of a soft-capping model take the explicit path.
            mask = (
                attention_mask if attention_mask is None or attention_mask.dtype == torch.bool else attention_mask == 0
            )
            return softcapped_attention(query, key, value, mask, scaling, softcap).transpose(1, 2), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # [B, H, q, D] -> [B, q, H, D], the layout transformers expects back from an attention function.
    layer_idx: Any = module.layer_idx
    output = kvlab_step.attend(layer_idx, query, key, value, scaling, softcap)
    return output.transpose(1, 2), None


_registered = False


def install_attention(model: PreTrainedModel) -> None:
    """Route the model's attention through kvlab (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_IMPLEMENTATION, _kvlab_attention)
        AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
        _registered = True
    model.config._attn_implementation = ATTENTION_IMPLEMENTATION
    for sub_config_name in getattr(model.config, "sub_configs", {}) or {}:
        sub_config = getattr(model.config, sub_config_name, None)
        if sub_config is not None:
            sub_config._attn_implementation = ATTENTION_IMPLEMENTATION
