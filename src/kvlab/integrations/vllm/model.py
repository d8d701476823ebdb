"""The model vLLM serves, as kvlab sees it: its directory, dtype name, identity and transformers copy."""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvlab.errors import ConfigError
from kvlab.models import LoadedModel, load_model
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.resolution import ChunkGeometry

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def model_directory(name: str | None = None) -> str:
    """A transformers directory vLLM can load for kvlab's model `name` (default: the embedded one).

    Embedded aliases and GGUF files are converted once into float32 safetensors (kvlab's own cache),
    the same files `kvlab generate` loads, so both compute the same KV and the same chunk keys.
    """
    # The resolution and conversion are kvlab's loader's own; vLLM only needs where the result lies.
    from kvlab.models.loading import _converted_gguf_dir, _resolve

    directory, gguf_file = _resolve(name or "smollm2")
    return _converted_gguf_dir(gguf_file) if gguf_file is not None else directory


def dtype_name(dtype: torch.dtype | str) -> str:
    """kvlab's name of vLLM's model dtype."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)  # type: ignore[assignment]
    name = _DTYPE_NAMES.get(dtype)  # type: ignore[arg-type]
    if name is None:
        raise ConfigError(f"kvlab handles vLLM models in {', '.join(_DTYPE_NAMES.values())}, not {dtype}")
    return name


def served_model(vllm_config: Any) -> tuple[str, str]:
    """(directory, dtype name) of the model a vLLM config serves."""
    model_config = vllm_config.model_config
    return str(model_config.model), dtype_name(model_config.dtype)


@functools.lru_cache(maxsize=4)
def transformers_model(directory: str, dtype: str) -> LoadedModel:
    """The served checkpoint loaded by kvlab (transformers modules, kvlab attention), once per process."""
    return load_model(directory, dtype=dtype)


@functools.lru_cache(maxsize=4)
def prefix_parameters(directory: str, dtype: str, chunk_tokens: int) -> tuple[str, int, ChunkGeometry]:
    """(identity, fp32 bytes per token, chunk geometry) that `kvlab generate` gives this checkpoint's chunks.

    The identity hashes the loaded model (config and sampled weights), so the checkpoint is loaded once
    per process to compute it (and freed right after); the rest comes from the same `for_model`.
    """
    loaded = load_model(directory, dtype=dtype)
    probe = PrefixCache.for_model(loaded, "memory://", PrefixConfig(chunk_tokens=chunk_tokens))
    return probe.model_identity, probe.raw_bytes_per_token, probe.geometry
