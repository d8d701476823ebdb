"""Shared fixtures: tiny random models (unit tests) and the embedded real model (integration tests)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvlab.models import LoadedModel, wrap_model

TINY_VOCAB = 96
TINY_EOS = 2


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over words w0..w95 (w2 is end-of-sequence), built in memory."""
    vocab = {f"w{i}": i for i in range(TINY_VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w2", pad_token="w1")
    return tokenizer


def tiny_llama(num_kv_heads: int = 2, seed: int = 0, num_layers: int = 3) -> LoadedModel:
    """A randomly initialised Llama (4 query heads; GQA when num_kv_heads < 4)."""
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        eos_token_id=TINY_EOS,
        bos_token_id=1,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return wrap_model(model, tiny_tokenizer(), name=f"tiny-llama-kv{num_kv_heads}")


@pytest.fixture(params=[4, 2], ids=["mha", "gqa"])
def tiny_model(request: pytest.FixtureRequest) -> LoadedModel:
    return tiny_llama(num_kv_heads=request.param)


@pytest.fixture(scope="session")
def embedded_model() -> LoadedModel:
    from kvlab.models import load_model

    return load_model()


class plain_attention:
    """Run a kvlab-prepared model through transformers' own SDPA attention (the reference path)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.config = loaded.model.config

    def __enter__(self) -> None:
        self.previous = self.config._attn_implementation
        self.config._attn_implementation = "sdpa"

    def __exit__(self, *exc: object) -> None:
        self.config._attn_implementation = self.previous


def transformers_greedy(loaded: LoadedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """New token ids of transformers' `generate(do_sample=False)`, the oracle for greedy decoding."""
    with plain_attention(loaded), torch.inference_mode():
        output = loaded.model.generate(
            torch.tensor([prompt], device=loaded.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=loaded.device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=loaded.tokenizer.pad_token_id or 0,
        )
    return output[0, len(prompt) :].tolist()
