"""kvlab's cache driven through the model gives exactly the plain transformers logits."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvlab.cache import FullKVLayer, KVCache, forward
from kvlab.models import LoadedModel
from tests.helpers import plain_attention, tiny_llama


def _random_ids(length: int, seed: int = 1, vocab: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=generator)


def _plain_logits(loaded: LoadedModel, ids: torch.Tensor, prefill: int) -> list[torch.Tensor]:
    """Prefill then one token at a time with transformers' DynamicCache and SDPA attention."""
    cache = DynamicCache(config=loaded.model.config)
    with plain_attention(loaded), torch.inference_mode():
        logits = [loaded.model(ids[:, :prefill], cache=cache).logits]
        for t in range(prefill, ids.shape[1]):
            logits.append(loaded.model(ids[:, t : t + 1], cache=cache).logits)
    return logits


def _kvlab_logits(loaded: LoadedModel, ids: torch.Tensor, prefill: int, capacity: int) -> list[torch.Tensor]:
    cache = KVCache.allocate(loaded.architecture, 1, capacity, loaded.dtype, loaded.device)
    logits = [forward(loaded.model, cache, ids[:, :prefill])]
    for t in range(prefill, ids.shape[1]):
        logits.append(forward(loaded.model, cache, ids[:, t : t + 1]))
    return logits


@pytest.mark.parametrize("capacity", [64, 8], ids=["preallocated", "grows"])
def test_prefill_and_decode_logits_are_bit_identical_to_transformers(tiny_model: LoadedModel, capacity: int) -> None:
    ids = _random_ids(48)
    expected = _plain_logits(tiny_model, ids, prefill=32)
    actual = _kvlab_logits(tiny_model, ids, prefill=32, capacity=capacity)
    for step, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert torch.equal(want, got), f"step {step}: max abs diff {(want - got).abs().max().item()}"


def test_chunked_forward_gives_the_same_argmax_as_sequential_steps(tiny_model: LoadedModel) -> None:
    ids = _random_ids(64, seed=3)
    sequential = torch.cat(_kvlab_logits(tiny_model, ids, prefill=32, capacity=64)[1:], dim=1)
    cache = KVCache.allocate(tiny_model.architecture, 1, 64, tiny_model.dtype, tiny_model.device)
    forward(tiny_model.model, cache, ids[:, :32])
    chunks = [forward(tiny_model.model, cache, ids[:, start : start + 8]) for start in range(32, 64, 8)]
    chunked = torch.cat(chunks, dim=1)
    mismatches = (sequential.argmax(-1) != chunked.argmax(-1)).nonzero().tolist()
    assert not mismatches, f"argmax differs at positions {mismatches}"
    torch.testing.assert_close(chunked, sequential, rtol=1e-5, atol=1e-5)


def test_crop_rolls_back_so_the_same_tokens_give_the_same_logits() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    ids = _random_ids(40, seed=4)
    cache = KVCache.allocate(loaded.architecture, 1, 64, loaded.dtype, loaded.device)
    forward(loaded.model, cache, ids[:, :30])
    first = forward(loaded.model, cache, ids[:, 30:36])
    cache.crop(30)
    assert cache.seq_lengths == [30] and all(layer.lengths == [30] for layer in cache.layers)  # type: ignore[attr-defined]
    other = forward(loaded.model, cache, ids[:, 34:40])
    assert not torch.equal(other, first), "different tokens after crop must change the logits"
    cache.crop(30)
    again = forward(loaded.model, cache, ids[:, 30:36])
    assert torch.equal(first, again)


def test_clone_is_independent_of_the_original() -> None:
    loaded = tiny_llama()
    ids = _random_ids(20, seed=5)
    cache = KVCache.allocate(loaded.architecture, 1, 32, loaded.dtype, loaded.device)
    forward(loaded.model, cache, ids[:, :10])
    copy = cache.clone()
    forward(loaded.model, cache, ids[:, 10:20])
    assert copy.seq_lengths == [10] and cache.seq_lengths == [20]
    continued_copy = forward(loaded.model, copy, ids[:, 10:20])
    cache.crop(10)
    continued_original = forward(loaded.model, cache, ids[:, 10:20])
    assert torch.equal(continued_copy, continued_original)


def test_nbytes_counts_stored_tokens_in_fp16_and_resident_bytes_count_the_buffers() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    arch = loaded.architecture
    cache = KVCache.allocate(arch, 1, 128, torch.float32, "cpu")
    assert cache.nbytes() == 0
    forward(loaded.model, cache, _random_ids(10))
    assert cache.nbytes() == 10 * arch.kv_bytes_per_token(element_size=2) == cache.full_nbytes()
    assert cache.resident_bytes() == 128 * arch.kv_bytes_per_token(element_size=4)


def test_rows_of_different_lengths_match_single_row_runs() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompts = [_random_ids(n, seed=n) for n in (7, 19, 12)]
    singles, caches = [], []
    for prompt in prompts:
        cache = KVCache.allocate(loaded.architecture, 1, 40, loaded.dtype, loaded.device)
        forward(loaded.model, cache, prompt)
        caches.append(cache)
        single = cache.clone()
        steps = [forward(loaded.model, single, torch.tensor([[5 + k]])) for k in range(4)]
        singles.append(torch.cat(steps, dim=1))
    batch = KVCache.stack(caches, capacity=40)
    assert batch.seq_lengths == [7, 19, 12]
    steps = [forward(loaded.model, batch, torch.tensor([[5 + k]] * 3)) for k in range(4)]
    batched = torch.cat(steps, dim=1)
    for row, single in enumerate(singles):
        assert torch.equal(batched[row].argmax(-1), single[0].argmax(-1)), f"row {row} argmax differs"
        torch.testing.assert_close(batched[row], single[0], rtol=1e-5, atol=1e-5)


def test_select_rows_keeps_the_chosen_rows_in_order() -> None:
    layer = FullKVLayer(batch_size=3, num_kv_heads=1, head_dim=2, capacity=4, dtype=torch.float32, device="cpu")
    keys = torch.arange(3 * 2 * 2, dtype=torch.float32).view(3, 1, 2, 2)
    layer.append(keys, -keys)
    layer.select_rows([2, 0])
    assert torch.equal(layer.stored(0)[0], keys[2]) and torch.equal(layer.stored(1)[1], -keys[0])
    assert layer.lengths == [2, 2]


def test_crop_refuses_to_grow_a_row() -> None:
    loaded = tiny_llama()
    cache = KVCache.allocate(loaded.architecture, 1, 16, loaded.dtype, loaded.device)
    forward(loaded.model, cache, _random_ids(5))
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(6)


def test_unused_slots_hold_finite_values_so_masked_attention_stays_finite() -> None:
    # Masked attention multiplies unused slots by a zero weight; NaN garbage there would leak (0 * NaN).
    layer = FullKVLayer(batch_size=2, num_kv_heads=1, head_dim=4, capacity=8, dtype=torch.float32, device="cpu")
    layer.append(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4))
    layer.drop_last([2, 0])
    layer.append(torch.ones(2, 1, 6, 4), torch.ones(2, 1, 6, 4))
    assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


def test_prefill_in_fixed_chunks_gives_a_chunk_the_same_bits_in_any_prompt(tiny_model: LoadedModel) -> None:
    """Kernels block by input length, so one forward over a longer prompt may change a token's last
    bits; cut at fixed boundaries, a chunk's KV does not depend on what follows it."""
    from kvlab.generation.prefill import PrefillCaches, prefill

    shared = [(11 * i + 5) % 90 + 3 for i in range(48)]
    caches = [
        prefill(tiny_model, [shared + tail], PrefillCaches(80), chunk_tokens=16)[0]
        for tail in ([7], [9, 4, 33, 17, 60, 61, 62, 5, 6], [8] * 20)
    ]
    for layers in zip(*(cache.layers for cache in caches), strict=True):
        keys = [layer.keys[:, :, :48] for layer in layers]  # type: ignore[attr-defined]
        assert all(torch.equal(keys[0], other) for other in keys[1:])


def test_padded_causal_attention_equals_masked_attention() -> None:
    from kvlab.attention import _padded_causal, visibility_mask

    torch.manual_seed(0)
    for heads, kv_heads in ((4, 4), (6, 2)):
        queries = torch.randn(2, heads, 70, 16)
        keys, values = torch.randn(2, kv_heads, 100, 16), torch.randn(2, kv_heads, 100, 16)
        positions = torch.arange(30, 100).expand(2, 70)
        mask = visibility_mask(positions, [100, 100], 100)
        gqa = heads != kv_heads
        expected = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=0.25, enable_gqa=gqa
        )
        assert torch.equal(_padded_causal(queries, keys, values, 0.25, gqa), expected)
