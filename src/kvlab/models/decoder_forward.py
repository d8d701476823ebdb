"""The forward every kvlab step runs: transformers' own for most families, a lean one for the Llama family.

A decode step of a small model on a CPU is a few hundred small operations around its matrix products,
and transformers' forward adds its own per-call work to each layer (argument decorators, keyword
plumbing, an attention-interface lookup, a causal mask kvlab's attention never reads). For the
families whose decoder layer is Llama's (Llama, Mistral, Qwen2, Qwen3: pre-norm blocks, q/k/v and
gate/up/down projections, rotary on every head, QK-norm per head in Qwen3), `causal_lm_forward`
computes what transformers' forward computes, in the same order, without that plumbing: the model's
own projections, MLP and rotary embedding, its RMS norms written out (the module's arithmetic), and
queries and keys rotated in one pass where their projections are fused (the same elementwise
products). The logits are bit-identical to transformers' forward through kvlab's attention (the tests
hold both paths to that on every family that takes this one). Every other family, or a model whose
layers were replaced, takes transformers' forward.

Where the linear layers are oneDNN-packed (`kvlab.models.packed_linear`), `fuse_projections` packs each
layer's q, k and v projections as one weight and its gate and up projections as another: a decode step
then reads its weights in 4 products a layer instead of 7 (SmolLM2's shapes with random weights, one
row, 2 threads: 211 products read 32.8 GB/s, 121 fused ones 37.9). oneDNN computes each output feature
with the same sums either way (the tests compare the fused lean forward with transformers' unfused one
bit for bit)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from kvlab.models.attention_hook import AttentionStep
from kvlab.models.packed_linear import fuse_parts

LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model types whose decoder layer the lean forward runs (their layers are Llama's, plus QK-norm in Qwen3)."""

COMPILED_FORWARD_ATTRIBUTE = "_kvlab_compiled_forward"
"""Where `kvlab.models.compiled_forward` keeps a model's compiled forward (absent: the eager one)."""

LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(layer index, queries [B, H, q, D], new keys, new values [B, H_kv, q, D], scaling) -> [B, H, q, D]."""

_LEAN_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"})


def runs_lean(model: torch.nn.Module) -> bool:
    """Whether `causal_lm_forward` takes the lean path for `model` (read once per model and kept on it)."""
    known = getattr(model, "_kvlab_runs_lean", None)
    if known is None:
        known = _lean_layout(model)
        model._kvlab_runs_lean = known  # type: ignore[assignment]
    return bool(known)


def use_transformers_forward(model: torch.nn.Module, transformers_forward: bool = True) -> None:
    """Make `causal_lm_forward` run transformers' own forward for `model` (False: back to the lean one
    where the model's layout allows it), to compare the two. On fused projections transformers' forward
    computes each fused product once per part: compare it on a model packed without fusing."""
    model._kvlab_runs_lean = False if transformers_forward else _lean_layout(model)  # type: ignore[assignment]


def _lean_layout(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES or inner is None or not hasattr(model, "lm_head"):
        return False
    layers = getattr(inner, "layers", None)
    return layers is not None and all(type(layer).__name__ in _LEAN_LAYER_CLASSES for layer in layers)


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse each decoder layer's q/k/v and gate/up projections where the lean forward runs and they are
    bias-free packed or float layers (`kvlab.models.packed_linear.fuse_parts`); returns how many it
    fused. transformers' forward still runs: each part computes the fused product and keeps its own
    features. Draft copies fuse their float copy before quantizing it (`kvlab.models.draft_weights`)."""
    if not runs_lean(model):
        return 0
    fused = 0
    for layer in model.model.layers:  # type: ignore[union-attr]
        fused += fuse_parts(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        fused += fuse_parts(layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj")
    return fused


def causal_lm_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int | torch.Tensor,
    step: AttentionStep,
) -> torch.Tensor:
    """Logits of feeding `input_ids` [B, q] at `position_ids` [B, q], attention computed by `step`.

    `logits_to_keep`: 0 keeps every position, n > 0 the last n, a tensor the positions it indexes
    (transformers' convention). Returns [B, kept, V]. A model compiled by
    `kvlab.models.compiled_forward.compile_forward` runs its compiled graph of the lean forward.
    """
    compiled = getattr(model, COMPILED_FORWARD_ATTRIBUTE, None)
    if compiled is not None:
        return compiled(model, input_ids, position_ids, logits_to_keep, step)  # type: ignore[no-any-return]
    if not runs_lean(model):
        output = model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=logits_to_keep,
            kvlab_step=step,
        )
        return output.logits
    kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return lean_forward(model, input_ids, position_ids, kept, step.attend)


def lean_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    kept: slice | torch.Tensor,
    attend: LayerAttention,
) -> torch.Tensor:
    """The Llama family's forward of `input_ids` [B, q] at `position_ids` [B, q], each layer's attention
    by `attend`; returns the logits [B, kept, V] of the positions `kept` selects."""
    inner = model.model  # type: ignore[attr-defined]
    hidden = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(hidden, position_ids)
    rotary = (cos.unsqueeze(1), sin.unsqueeze(1))  # [B, 1, q, D]: broadcast over heads
    for layer in inner.layers[: model.config.num_hidden_layers]:
        hidden = hidden + _attention(layer.self_attn, _rms_norm(layer.input_layernorm, hidden), rotary, attend)
        hidden = hidden + _mlp(layer.mlp, _rms_norm(layer.post_attention_layernorm, hidden))
    hidden = _rms_norm(inner.norm, hidden)
    return model.lm_head(hidden[:, kept, :])  # type: ignore[operator]


def _attention(
    attention: Any, hidden: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], attend: LayerAttention
) -> torch.Tensor:
    """One layer's self-attention as the Llama family's forward computes it, attention itself by `attend`."""
    input_shape = hidden.shape[:-1]
    head_shape = (*input_shape, -1, attention.head_dim)
    cos, sin = rotary
    fused = getattr(attention, "qkv_proj", None)
    q_norm = getattr(attention, "q_norm", None)
    if fused is not None and q_norm is None:
        # Queries and keys side by side in the fused output: one rotary pass over both (the same
        # elementwise products, so the same bits as two).
        num_q, num_k = attention.q_proj.out_features, attention.k_proj.out_features
        projected = fused(hidden)
        both = projected[..., : num_q + num_k].view(head_shape).transpose(1, 2)
        both = both * cos + _rotate_half(both) * sin
        queries, keys = both.split([num_q // attention.head_dim, num_k // attention.head_dim], dim=1)
        values = projected[..., num_q + num_k :].view(head_shape).transpose(1, 2)
    else:
        if fused is None:
            queries, keys, values = attention.q_proj(hidden), attention.k_proj(hidden), attention.v_proj(hidden)
        else:
            sizes = [attention.q_proj.out_features, attention.k_proj.out_features, attention.v_proj.out_features]
            queries, keys, values = fused(hidden).split(sizes, dim=-1)
        queries, keys = queries.view(head_shape), keys.view(head_shape)
        values = values.view(head_shape).transpose(1, 2)
        if q_norm is not None:  # Qwen3: RMS norm over each head before rotary
            queries, keys = q_norm(queries), attention.k_norm(keys)
        queries, keys = queries.transpose(1, 2), keys.transpose(1, 2)
        queries = queries * cos + _rotate_half(queries) * sin
        keys = keys * cos + _rotate_half(keys) * sin
    output = attend(attention.layer_idx, queries, keys, values, attention.scaling)  # [B, H, q, D]
    return attention.o_proj(output.transpose(1, 2).reshape(*input_shape, -1).contiguous())


def _rms_norm(norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The family's RMSNorm module's forward, written out (its casts to float32 and back are no-ops on
    float32 models and are skipped there; the arithmetic is the module's, so are the bits)."""
    if hidden.dtype != torch.float32:
        return norm(hidden)  # type: ignore[no-any-return]
    scaled = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * scaled  # type: ignore[no-any-return]


def _mlp(mlp: Any, hidden: torch.Tensor) -> torch.Tensor:
    fused = getattr(mlp, "gate_up_proj", None)
    if fused is None:
        return mlp(hidden)
    gate, up = fused(hidden).split([mlp.gate_proj.out_features, mlp.up_proj.out_features], dim=-1)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
