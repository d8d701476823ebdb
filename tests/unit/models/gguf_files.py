"""Write a tiny transformers model as a float32 GGUF file the way llama.cpp's converter lays it out.

Test support only: names come from transformers' own GGUF name map, metadata keys from its GGUF
config map, and the two tensor transforms its loader undoes (llama's rotary row order for q/k, and
Gemma's `1 + weight` norms) are applied forward. A model written here and loaded back must carry
the same weights bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

GGUF_ARCHITECTURES = {"gemma3_text": "gemma3", "mistral": "llama", "gpt_neox": "gptneox"}
"""GGUF architecture names that differ from transformers' model type (Mistral files say "llama")."""


def gguf_architecture(model_type: str) -> str:
    return GGUF_ARCHITECTURES.get(model_type, model_type)


def write_gguf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path) -> Path:
    """Write `model` (float32) and a BPE tokenizer over `tokenizer`'s vocabulary to `path`."""
    config = model.config
    arch = gguf_architecture(config.model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {config.model_type}")
    for key, value in _metadata(config, arch).items():
        _add_value(writer, f"{arch}.{key}", value)
    _add_tokenizer(writer, tokenizer)
    for name, tensor in _tensors(model, arch).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _metadata(config: Any, arch: str) -> dict[str, Any]:
    values = {"rope_theta": (getattr(config, "rope_parameters", None) or {}).get("rope_theta")}
    metadata = {}
    for key, attribute in GGUF_CONFIG_MAPPING.get(arch, {}).items():
        if attribute is None:
            continue
        value = values[attribute] if attribute in values else getattr(config, attribute, None)
        if value is not None:
            metadata[key] = value
    return metadata


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, str(value))


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerBase) -> None:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_token_merges([])
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{role}_token_id", None)
        if token_id is not None:
            getattr(writer, {"unk": "add_unk_token_id"}.get(role, f"add_{role}_token_id"))(token_id)


def _tensors(model: PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    gguf_to_hf = get_gguf_hf_weights_map(model, processor, model_type=arch)
    state = model.state_dict()
    tensors = {}
    for gguf_name, hf_name in gguf_to_hf.items():
        if hf_name not in state or (gguf_name == "output.weight" and model.config.tie_word_embeddings):
            continue
        weights = state[hf_name].detach().float().cpu().numpy()
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = model.config.num_attention_heads if ".attn_q." in gguf_name else model.config.num_key_value_heads
            weights = _permute_rotary_rows(weights, heads)
        if arch in ("gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            weights = weights + 1
        tensors[gguf_name] = np.ascontiguousarray(weights)
    return tensors


def _permute_rotary_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for q/k projections (rotary halves interleaved); the loader inverts it."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape
    )
