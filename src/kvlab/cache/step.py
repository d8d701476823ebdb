"""Run a model forward whose attention reads and writes a `KVCache`."""

from __future__ import annotations

import dataclasses

import torch
from transformers import PreTrainedModel

from kvlab.attention import attend_newest_each
from kvlab.cache.kv_cache import KVCache
from kvlab.models.decoder_forward import causal_lm_forward


@dataclasses.dataclass(slots=True)
class ForwardStep:
    """The cache and query positions of one forward; the attention hook calls `attend` per layer.

    Attributes:
        cache: Where new keys/values go and past ones come from.
        query_positions: [B, q] int64 true positions of the tokens being fed.
        compress: This forward feeds the whole prompt: compressed layers compress it afterwards.
        captured: When a list, each layer's new keys/values ([B, H_kv, q, D], rotary applied) are
            appended to it: the exact KV of the fed tokens, for a draft cache or a prefix store.
        mask_positions: [B, q] positions that decide causal visibility when they differ from the true
            ones: a cache that stores only some earlier tokens (compacted, so a key's index is not its
            position) masks new queries by their index among the stored keys.
    """

    cache: KVCache
    query_positions: torch.Tensor
    compress: bool = False
    captured: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    mask_positions: torch.Tensor | None = None

    def attend(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if self.captured is not None:
            self.captured.append((new_keys, new_values))
        layer = self.cache.layers[layer_idx]
        layer.append(new_keys, new_values)
        positions = self.query_positions if self.mask_positions is None else self.mask_positions
        output = layer.attend(queries, positions, scaling, softcap)
        if self.compress:
            layer.compress_prompt(queries, scaling, layer_idx)
        return output


@dataclasses.dataclass(slots=True)
class PairedPrefillStep(ForwardStep):
    """Prefill that fills the full cache exactly and gives a compressed copy of the prompt to a second
    cache (the drafter's), from the same forward. A prompt prefilled in pieces compresses the draft
    once, after its last piece (`compress_draft`)."""

    draft_cache: KVCache | None = None
    compress_draft: bool = True

    def attend(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        output = ForwardStep.attend(self, layer_idx, queries, new_keys, new_values, scaling, softcap)
        assert self.draft_cache is not None
        draft_layer = self.draft_cache.layers[layer_idx]
        draft_layer.append(new_keys, new_values)
        if self.compress_draft:
            draft_layer.compress_prompt(queries, scaling, layer_idx)
        return output


@torch.inference_mode()
def run_step(
    model: PreTrainedModel, step: ForwardStep, input_ids: torch.Tensor, logits_to_keep: int = 0
) -> torch.Tensor:
    """Feed `input_ids` [B, q] through `model` with attention handled by `step`; advances its cache."""
    if input_ids.shape[0] != step.cache.batch_size:
        raise ValueError(f"input has {input_ids.shape[0]} rows but the cache holds {step.cache.batch_size}")
    logits = causal_lm_forward(model, input_ids, step.query_positions, logits_to_keep, step)
    step.cache.advance(input_ids.shape[1])
    return logits


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
    positions = cache.next_positions(input_ids.shape[1], input_ids.device)
    return run_step(model, ForwardStep(cache, positions, compress), input_ids, logits_to_keep)


@dataclasses.dataclass(slots=True)
class Segment:
    """One sequence's tokens in a packed forward.

    Attributes:
        cache: The sequence's cache (a batch of one row); its stored tokens precede the segment's.
        num_tokens: Tokens this segment feeds.
        captured: When a list, each layer's new keys/values ([1, H_kv, q, D]) are appended to it.
        compress: The segment completes the prompt: compressed layers compress it afterwards.
    """

    cache: KVCache
    num_tokens: int
    captured: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    compress: bool = False


@dataclasses.dataclass(slots=True)
class PackedStep:
    """A forward over several sequences packed into one row of tokens, each attending over its own
    cache (draft and full caches may mix). Linear layers read the weights once for every segment;
    attention runs per segment, whose queries are always the newest keys of its cache; the segments whose
    layers show their keys plainly (`KVLayer.newest_kv`) go to `kvlab.attention.attend_newest_each`, which
    takes the decode steps, drafts and short verifies among them in one kernel call."""

    segments: list[Segment]
    positions: list[torch.Tensor]  # per segment, [1, q] int64 true positions

    def attend(
        self,
        layer_idx: int,
        queries: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        outputs: list[torch.Tensor | None] = []
        # Segments over plainly visible keys (decode and draft steps, verifies) attend together.
        stepping: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        start = 0
        for index, (segment, positions) in enumerate(zip(self.segments, self.positions, strict=True)):
            end = start + segment.num_tokens
            keys, values = new_keys[:, :, start:end], new_values[:, :, start:end]
            if segment.captured is not None:
                segment.captured.append((keys, values))
            layer = segment.cache.layers[layer_idx]
            layer.append(keys, values)
            segment_queries = queries[:, :, start:end]
            stored = layer.newest_kv() if softcap is None and not segment.compress else None
            if stored is not None:
                stepping.append((index, segment_queries, *stored))
                outputs.append(None)
            else:
                outputs.append(layer.attend_newest(segment_queries, positions, scaling, softcap))
                if segment.compress:
                    layer.compress_prompt(segment_queries, scaling, layer_idx)
            start = end
        if stepping:
            indices, step_queries, step_keys, step_values = zip(*stepping, strict=True)
            for index, output in zip(indices, attend_newest_each(
                    list(step_queries), list(step_keys), list(step_values), scaling), strict=True):
                outputs[index] = output
        ready = [output for output in outputs if output is not None]
        assert len(ready) == len(outputs)
        return ready[0] if len(ready) == 1 else torch.cat(ready, dim=2)


@torch.inference_mode()
def run_packed(
    model: PreTrainedModel, segments: list[Segment], token_ids: list[list[int]], logits_at: list[int]
) -> torch.Tensor:
    """Feed each segment's `token_ids` after what its cache holds, in one forward; advances the caches.

    Args:
        model: A model prepared by `kvlab.models.load_model`.
        segments: One per sequence; `segments[i].num_tokens == len(token_ids[i])`.
        token_ids: The tokens of each segment.
        logits_at: Indices into the packed tokens whose logits are wanted.

    Returns:
        [len(logits_at), V] logits.
    """
    device = model.device
    positions = [segment.cache.next_positions(segment.num_tokens, device) for segment in segments]
    input_ids = torch.tensor([[token for tokens in token_ids for token in tokens]], dtype=torch.long, device=device)
    step = PackedStep(segments, positions)
    logits = causal_lm_forward(
        model, input_ids, torch.cat(positions, dim=1), torch.tensor(logits_at, device=device), step
    )
    for segment in segments:
        segment.cache.advance(segment.num_tokens)
    return logits[0]
