"""Run a model forward whose attention reads and writes a `KVCache`."""

from __future__ import annotations

import dataclasses

import torch
from transformers import PreTrainedModel

from kvlab.cache.kv_cache import KVCache


@dataclasses.dataclass(slots=True)
class ForwardStep:
    """The cache and query positions of one forward; the attention hook calls `attend` per layer.

    Attributes:
        cache: Where new keys/values go and past ones come from.
        query_positions: [B, q] int64 true positions of the tokens being fed.
        compress: This forward feeds the whole prompt: compressed layers compress it afterwards.
    """

    cache: KVCache
    query_positions: torch.Tensor
    compress: bool = False

    def attend(
        self, layer_idx: int, queries: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        layer = self.cache.layers[layer_idx]
        layer.append(new_keys, new_values)
        output = layer.attend(queries, self.query_positions, scaling)
        if self.compress:
            layer.compress_prompt(queries, scaling, layer_idx)
        return output


@torch.inference_mode()
def forward(
    model: PreTrainedModel, cache: KVCache, input_ids: torch.Tensor, logits_to_keep: int = 0, compress: bool = False
) -> torch.Tensor:
    """Feed `input_ids` [B, q] after what `cache` holds, storing their keys/values in it.

    Positions are explicit (`cache.seq_lengths` + arange), so a cache that stores fewer tokens than
    the sequence still gets the right rotary phases.

    Args:
        model: A model prepared by `kvlab.models.load_model` (attention routed to kvlab).
        cache: The cache to extend; its rows advance by q.
        input_ids: [B, q] int64 token ids.
        logits_to_keep: Keep logits of the last n positions only (0 keeps all).
        compress: The input is the whole prompt; compressed layers compress it after attending
            (attention of the prompt itself is always exact).

    Returns:
        [B, q or logits_to_keep, V] logits.
    """
    if input_ids.shape[0] != cache.batch_size:
        raise ValueError(f"input has {input_ids.shape[0]} rows but the cache holds {cache.batch_size}")
    positions = cache.next_positions(input_ids.shape[1], input_ids.device)
    step = ForwardStep(cache, positions, compress)
    output = model(
        input_ids=input_ids,
        position_ids=positions,
        use_cache=False,
        logits_to_keep=logits_to_keep,
        kvlab_step=step,
    )
    cache.advance(input_ids.shape[1])
    return output.logits
