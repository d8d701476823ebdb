"""What kvlab needs to know about a model's attention, read once from its config.

This is the only place that interprets architecture-specific config fields (head counts, GQA groups,
head size, sliding-window layers, usable context). Everything else asks a `ModelArchitecture`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab.errors import ConfigError


@dataclasses.dataclass(frozen=True, slots=True)
class ModelArchitecture:
    """Attention geometry of a decoder-only model.

    Attributes:
        model_type: The config's `model_type` ("llama", "gemma3_text", ...).
        num_layers: Decoder layers, each with its own KV cache layer.
        num_heads: Query heads per layer.
        num_kv_heads: Key/value heads per layer (GQA when smaller than `num_heads`).
        head_dim: Size of one head.
        sliding_windows: Per layer, the attention window in tokens, or None for full attention.
        max_context: Positions the model was trained for; longer sequences are refused.
    """

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int | None, ...]
    max_context: int

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, element_size: int = 2) -> int:
        """Bytes of keys and values one token occupies across all layers (fp16 by default)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_config(cls, config: Any) -> ModelArchitecture:
        """Read the attention geometry of a transformers config, or explain why it is unsupported."""
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        try:
            num_layers = int(text_config.num_hidden_layers)
            num_heads = int(text_config.num_attention_heads)
        except AttributeError as error:
            raise ConfigError(
                f"model type {getattr(config, 'model_type', '?')!r} is not a decoder-only transformer kvlab supports "
                f"(missing {error.name})"
            ) from None
        _check_supported(text_config)
        num_kv_heads = int(getattr(text_config, "num_key_value_heads", None) or num_heads)
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        return cls(
            model_type=str(getattr(text_config, "model_type", "unknown")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            sliding_windows=_sliding_windows(text_config, num_layers),
            max_context=int(getattr(text_config, "max_position_embeddings", 0) or 2048),
        )


def _check_supported(config: Any) -> None:
    """Refuse configs whose attention kvlab's cache cannot compute, naming the missing feature."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"model type {model_type!r} is an encoder-decoder model; kvlab serves decoder-only models")
    unknown_layers = sorted(set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES)
    if unknown_layers:
        raise ConfigError(
            f"model type {model_type!r} has {', '.join(unknown_layers)} layers; kvlab's cache implements only "
            f"{' and '.join(sorted(_ATTENTION_LAYER_TYPES))} layers"
        )


_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def _sliding_windows(config: Any, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return (None,) * num_layers
    if layer_types is None:
        # Models without per-layer types (Mistral style) apply the window on every layer.
        return (int(window),) * num_layers
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
