"""The model fingerprint covers every weight: a one-weight change anywhere gives new store keys, and a
changed checkpoint file is hashed afresh, never served a digest cached for the old one."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from kvlab.models import load_model, model_identity
from kvlab.models.identity import identity_cache_dir
from tests.helpers import TINY_VOCAB, tiny_llama


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "cache"))


def wide_llama() -> LlamaForCausalLM:
    """Parameters of up to 2**17 values: a strided sample of 4096 values (the old fingerprint) skips most."""
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_changing_one_weight_of_any_parameter_anywhere_changes_the_fingerprint() -> None:
    model = wide_llama()
    original = model_identity(model)
    names = [name for name, _ in model.named_parameters()]
    assert any("k_proj" in name for name in names) and any("v_proj" in name for name in names)
    for name in names:
        numel = dict(model.named_parameters())[name].numel()
        # The middle of the tensor plus one (off any stride the old sample used), and its last element.
        for position in sorted({numel // 2 + 1 if numel > 2 else 0, numel - 1}):
            changed = copy.deepcopy(model)
            with torch.no_grad():
                flat = dict(changed.named_parameters())[name].view(-1)
                flat[position] = torch.nextafter(flat[position], torch.tensor(float("inf")))
            assert model_identity(changed) != original, f"{name}[{position}] changed, the fingerprint did not"


def test_a_weight_changed_in_place_is_seen_by_the_same_model_object() -> None:
    model = wide_llama()
    before = model_identity(model)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[100, 200] += 1e-3
    assert model_identity(model) != before


def test_a_changed_checkpoint_file_invalidates_the_cached_digest(tmp_path: Path) -> None:
    directory = tmp_path / "model"
    tiny = tiny_llama(num_kv_heads=2, seed=3)
    tiny.model.save_pretrained(directory)
    tiny.tokenizer.save_pretrained(directory)
    first = model_identity(load_model(str(directory)).model)
    assert len(list(identity_cache_dir().iterdir())) == 1, "the digest of a model from files is cached"
    assert model_identity(load_model(str(directory)).model) == first, "the same files give the same fingerprint"
    weights_file = directory / "model.safetensors"
    weights = load_file(weights_file)
    name = next(name for name in sorted(weights) if "k_proj" in name)
    weights[name].view(-1)[weights[name].numel() // 2 + 1] += 1e-3
    save_file(weights, weights_file, metadata={"format": "pt"})
    assert model_identity(load_model(str(directory)).model) != first, "a changed checkpoint kept its old fingerprint"
    assert len(list(identity_cache_dir().iterdir())) == 2
