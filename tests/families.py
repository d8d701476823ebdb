"""Model families of the architecture matrix: tiny random configs, built with no download.

A new family is one `FAMILIES` entry; every capability test in `tests/unit/models/` runs on it. A
causal-LM model type transformers can build that is neither here nor in `NOT_IN_MATRIX` (with the
reason) fails `test_every_causal_lm_family_is_in_the_matrix_or_has_a_reason`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from kvlab.models import LoadedModel, wrap_model
from tests.helpers import TINY_EOS, TINY_VOCAB, tiny_tokenizer

TEST_DEVICE = os.environ.get("KVLAB_TEST_DEVICE", "cpu")
"""Where the matrix's models run (`scripts/gpu-check` sets it to the accelerator)."""

SLIDING_WINDOW = 8
"""Small enough that the matrix's prompts (tens of tokens) run past it."""

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "eos_token_id": TINY_EOS,
    "bos_token_id": 1,
    "pad_token_id": 1,
}


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture family in the matrix.

    Attributes:
        name: Test id ("llama-gqa").
        model_type: transformers' `model_type` of the config ("gemma3_text").
        feature: What this entry exercises that the others do not.
        overrides: Config fields on top of the common tiny geometry.
        unsupported: What kvlab lacks for this family, or None; every capability then is an expected
            failure with this reason (a `ConfigError` naming it).
        refusal: A regex the `ConfigError` of an unsupported family must match.
    """

    name: str
    model_type: str
    feature: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    unsupported: str | None = None
    refusal: str = ""

    def config(self) -> PretrainedConfig:
        return AutoConfig.for_model(self.model_type, **{**_COMMON, **self.overrides})

    def build_hf(self, seed: int = 0) -> PreTrainedModel:
        """The randomly initialised transformers model (float32, eval mode) on `TEST_DEVICE`."""
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(self.config(), dtype=torch.float32)
        return model.to(TEST_DEVICE).eval()

    def build(self, seed: int = 0) -> LoadedModel:
        """The model prepared for kvlab, with the tiny word-level tokenizer."""
        return wrap_model(self.build_hf(seed), tiny_tokenizer(), name=f"tiny-{self.name}")


FAMILIES: tuple[Family, ...] = (
    Family("llama-mha", "llama", "multi-head attention", {"num_key_value_heads": 4}),
    Family("llama-gqa", "llama", "grouped-query attention (2 query heads per KV head)"),
    Family("qwen2", "qwen2", "q/k/v projection biases"),
    Family("qwen3", "qwen3", "RMS norm on queries and keys per head (QK-norm), head_dim 128 > hidden / heads",
           {"head_dim": 128}),
    Family("mistral", "mistral", "sliding window on every layer", {"sliding_window": SLIDING_WINDOW}),
    Family(
        "gemma2",
        "gemma2",
        "attention logit soft-capping, alternating sliding layers, final logit soft-capping",
        # A cap of 0.5 (Gemma 2 ships 50) bends the tiny model's small scores, so the cap is exercised.
        {"head_dim": 16, "sliding_window": SLIDING_WINDOW, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 0.5},
    ),
    Family(
        "gemma3",
        "gemma3_text",
        "five sliding layers to one global (Gemma 3's pattern), QK-norm, scaled embeddings",
        {
            "head_dim": 16,
            "num_hidden_layers": 6,
            "num_key_value_heads": 1,
            "sliding_window": SLIDING_WINDOW,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        },
    ),
    Family("phi3", "phi3", "fused qkv and gate/up projections, partial-free rotary"),
    Family("olmo2", "olmo2", "post-norm blocks, QK-norm over all heads"),
    Family("starcoder2", "starcoder2", "layer norm with biases, plain GELU MLP, biased projections",
           {"use_bias": True}),
    Family("gpt_neox", "gpt_neox", "parallel residual, fused qkv, partial rotary (25% of each head)",
           {"rotary_pct": 0.25, "num_key_value_heads": 4}),
)



def family_named(name: str) -> Family:
    return next(family for family in FAMILIES if family.name == name)


def family_params(capability: str = "") -> list[Any]:
    """pytest params over `FAMILIES`; a family kvlab does not support is a strict expected failure."""
    params = []
    for family in FAMILIES:
        marks = []
        if family.unsupported is not None:
            from kvlab.errors import ConfigError

            reason = f"kvlab does not implement {family.unsupported}"
            marks.append(pytest.mark.xfail(strict=True, raises=ConfigError, reason=reason))
        params.append(pytest.param(family, id=family.name, marks=marks))
    return params

_ENCODER = "encoder or encoder-decoder stack (bidirectional or cross-attention); kvlab serves decoder-only models"
_RECURRENT = "recurrent, state-space or linear-attention layers keep a state, not a per-token KV cache"
_MULTIMODAL = "multimodal or audio model: its text decoder, when it has one, is the family to test"
_LATENT = "latent (MLA), indexed or compressed sparse attention: the cache holds a latent, not per-head keys/values"
_ALIBI = "ALiBi or relative position biases live in the attention mask, which kvlab's attention does not apply"
_MOE = "mixture-of-experts variant of a dense family: experts change the MLP, not attention; not yet run in the matrix"
_CHUNKED = (
    "chunked, block-sparse or hashed (LSH) local attention: "
    "kvlab's cache masks only causal and sliding-window attention"
)
_UNTESTED = "dense decoder-only transformer not yet run in the matrix (add a FAMILIES entry to cover it)"

NOT_IN_MATRIX: dict[str, str] = {
    **dict.fromkeys(
        ["bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small",
         "camembert", "data2vec-text", "electra", "ernie", "marian", "mbart", "megatron-bert", "mvp", "pegasus",
         "plbart", "prophetnet", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "trocr",
         "whisper", "xlm", "xlm-roberta", "xlm-roberta-xl", "xlnet", "xmod", "modernbert-decoder"],
        _ENCODER,
    ),
    **dict.fromkeys(
        ["bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear",
         "lara_mini", "lfm2", "lfm2_moe", "lfm3", "mamba", "mamba2", "minimax", "nemotron_h", "olmo_hybrid",
         "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "recurrent_gemma", "rwkv",
         "xlstm", "zamba", "zamba2", "zaya", "inkling_text", "inkling2_text", "inkling2_loop_text", "qwen4_exp_text"],
        _RECURRENT,
    ),
    **dict.fromkeys(
        ["gemma3", "gemma3n", "gemma3n_text", "gemma4", "gemma4_unified", "mllama", "emu3", "fuyu", "git",
         "got_ocr2", "phi4_multimodal", "moshi", "musicgen", "musicgen_melody", "moss_transcribe_diarize",
         "minimax_m3_vl_text", "aria_text", "dots3_note", "qwen4_exp"],
        _MULTIMODAL,
    ),
    **dict.fromkeys(
        ["axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "dots3_note_text",
         "glm4_moe_lite", "glm_moe_dsa", "hy_v4", "longcat_flash", "minicpm3", "sarvam_mla", "youtu"],
        _LATENT,
    ),
    **dict.fromkeys(["bloom", "mpt", "cpmant"], _ALIBI),
    **dict.fromkeys(["llama4", "llama4_text", "gpt_neo", "blt", "reformer"], _CHUNKED),
    **dict.fromkeys(
        ["afmoe", "beam", "cohere2_moe", "dbrx", "doge", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint",
         "glm4_moe", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoeshared", "hunyuan_v1_moe", "hy_v3",
         "jetmoe", "kolibri1", "laguna", "mellum", "mimo_v2_flash", "minimax_m2", "mixtral", "olmoe", "phimoe",
         "qwen2_moe", "qwen3_moe", "sarvam_moe"],
        _MOE,
    ),
    **dict.fromkeys(
        ["apertus", "apertus1p5_text", "arcee", "biogpt", "bitnet", "codegen", "cohere", "cohere2",
         "cohere_compass_text", "ctrl", "cwm", "diffllama", "falcon", "hrm_text", "solar_open", "xglm", "dory",
         "ernie4_5", "exaone", "exaone4", "gemma",
         "gemma4_text", "gemma4_unified_text", "gemma4_assistant", "gemma4_unified_assistant", "glm", "glm4",
         "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neox_japanese", "gptj", "granite", "granite_swa", "helium",
         "hunyuan_v1_dense", "hyperclovax", "internlm3", "iquestcoder", "jais2", "ministral", "ministral3",
         "nanochat", "nemotron", "olmo", "olmo3", "openai-gpt", "opt", "persimmon", "phi", "seed_oss", "smollm3",
         "stablelm", "vaultgemma"],
        _UNTESTED,
    ),
}
"""Causal-LM model types transformers builds that the matrix does not run, each with the reason."""
