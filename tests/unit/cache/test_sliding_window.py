"""Sliding-window layers (Gemma 3 style) attend only within their window on kvlab's cache."""

from __future__ import annotations

import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

from kvlab.cache import KVCache, forward
from kvlab.models import LoadedModel, wrap_model
from tests.helpers import plain_attention, tiny_tokenizer

WINDOW = 8


def _tiny_gemma3(layer_types: list[str] | None = None) -> LoadedModel:
    config = Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=layer_types or ["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return wrap_model(Gemma3ForCausalLM(config), tiny_tokenizer(), name="tiny-gemma3")


def test_architecture_reads_the_window_of_each_layer() -> None:
    assert _tiny_gemma3().architecture.sliding_windows == (WINDOW, WINDOW, WINDOW, None)


def test_logits_match_transformers_past_the_window() -> None:
    loaded = _tiny_gemma3()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    reference_cache = DynamicCache(config=loaded.model.config)
    with plain_attention(loaded), torch.inference_mode():
        expected = [loaded.model(ids[:, :20], cache=reference_cache).logits]
        expected += [loaded.model(ids[:, t : t + 1], cache=reference_cache).logits for t in range(20, 40)]
    cache = KVCache.allocate(loaded.architecture, 1, 40, loaded.dtype, loaded.device)
    actual = [forward(loaded.model, cache, ids[:, :20])]
    actual += [forward(loaded.model, cache, ids[:, t : t + 1]) for t in range(20, 40)]
    for step, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert torch.equal(want.argmax(-1), got.argmax(-1)), f"step {step}: argmax differs"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_the_window_hides_tokens_beyond_the_receptive_field() -> None:
    # Four sliding layers of window 8 see 4 * 7 = 28 positions back: position 28 still depends on
    # token 0, position 29 no longer does.
    loaded = _tiny_gemma3(layer_types=["sliding_attention"] * 4)
    base = torch.randint(3, 96, (1, 32), generator=torch.Generator().manual_seed(1))
    changed = base.clone()
    changed[0, 0] = 3 if base[0, 0] != 3 else 4
    outputs = []
    for ids in (base, changed):
        cache = KVCache.allocate(loaded.architecture, 1, 32, loaded.dtype, loaded.device)
        outputs.append(forward(loaded.model, cache, ids)[0])
    assert not torch.equal(outputs[0][28], outputs[1][28]), "position 28 should still see token 0"
    assert torch.equal(outputs[0][29:], outputs[1][29:]), "positions past the receptive field changed"
