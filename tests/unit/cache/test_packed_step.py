"""A packed forward's attention: its decode steps, drafts and short verifies in one kernel call, every segment as
it is alone."""

from __future__ import annotations

import pytest
import torch

from kvlab import attention_kernels
from kvlab.cache import KVCache, Segment, forward, run_packed
from kvlab.compress import create_compressor
from kvlab.generation.prefill import PrefillCaches, prefill
from tests.helpers import spy_on_newest_attention, tiny_llama

PROMPTS = [[5 + (i * 11 + j * 3) % 80 for j in range(30 + 13 * i)] for i in range(4)]


def caches(model: object) -> list[KVCache]:
    """Two full caches, an evicted (SnapKV) draft cache, and an empty full cache for a prefill piece."""
    architecture = model.architecture  # type: ignore[attr-defined]
    full = []
    for prompt in PROMPTS[:2]:
        cache = KVCache.allocate(architecture, 1, 128, torch.float32, "cpu")
        forward(model.model, cache, torch.tensor([prompt]))  # type: ignore[attr-defined]
        full.append(cache)
    _, draft, _ = prefill(model, [PROMPTS[2]], PrefillCaches(128, drafter=create_compressor("snapkv", budget=12)))
    assert draft is not None
    return [*full, draft, KVCache.allocate(architecture, 1, 128, torch.float32, "cpu")]


def test_a_packed_forward_attends_its_steps_and_short_verifies_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step, a draft step on an evicted cache, a verify and a prefill piece in one forward: each
    segment's logits are the ones it gets alone (attention bit for bit, the linear layers' rows within float32
    rounding), and each layer calls the C++ kernel once for the step, the draft and the verify (2 x 3 rows
    per KV head); the prefill piece (2 x 12 rows) takes the matrix-product paths."""
    model = tiny_llama(num_kv_heads=2, seed=3)
    tokens = [[7], [9, 10, 11], [12], PROMPTS[3][:12]]
    alone = []
    for cache, ids in zip(caches(model), tokens, strict=True):
        alone.append(run_packed(model.model, [Segment(cache, len(ids))], [ids], list(range(len(ids)))))
    calls = spy_on_newest_attention(monkeypatch)
    segments = [Segment(cache, len(ids)) for cache, ids in zip(caches(model), tokens, strict=True)]
    order = [3, 0, 1, 2]  # the prefill piece first, the one-token segments apart
    logits = run_packed(model.model, [segments[i] for i in order], [tokens[i] for i in order],
                        list(range(sum(map(len, tokens)))))
    assert attention_kernels.NEWEST_ATTENTION_MAX_ROWS < 2 * 12
    assert calls == [[1, 3, 1]] * model.architecture.num_layers, calls
    start = 0
    for ids, expected in ((tokens[i], alone[i]) for i in order):
        got = logits[start:start + len(ids)]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        start += len(ids)
