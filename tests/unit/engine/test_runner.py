"""The runner outside the engine: coroutines of feeds run to their ends, each forward packing the next feed of
every one still running, give what each gives alone (the vLLM proposer drafts this way)."""

from __future__ import annotations

from collections.abc import Generator

import torch

from kvlab.cache import KVCache
from kvlab.compress import create_compressor
from kvlab.engine.runner import PackedBatch, run_to_end
from kvlab.generation import GenerationConfig
from kvlab.generation.feed import Feed
from kvlab.generation.prefill import PrefillCaches, prefill
from kvlab.lossless.compressed_cache import CompressedCacheDrafter
from kvlab.lossless.drafter import Offer, Proposal
from tests.helpers import tiny_llama

GREEDY = GenerationConfig(max_new_tokens=64, temperature=0.0)
PROMPTS = [[5 + (i * 7 + j * 3) % 80 for j in range(24 + 9 * i)] for i in range(3)]


class Row:
    """What the compressed-cache drafter reads of a sequence: a draft cache and the tokens it lacks."""

    def __init__(self, draft: KVCache, pending: list[int]) -> None:
        self.draft, self.pending, self.draft_missing = draft, pending, len(pending)
        self.full, self.in_transit, self.draft_logits = None, False, None
        self.config, self.generator = GREEDY, None


def draft_caches() -> tuple[object, list[KVCache]]:
    model = tiny_llama(num_kv_heads=2, seed=5)
    caches = []
    for prompt in PROMPTS:
        _, draft, _ = prefill(model, [prompt[:-1]], PrefillCaches(64, drafter=create_compressor("snapkv", budget=12)))
        assert draft is not None
        caches.append(draft)
    return model, caches


def drafts(model: object, rows: list[Row], lengths: list[int],
           forwards: list[list[int]]) -> list[Proposal]:
    drafter = CompressedCacheDrafter()
    rounds: list[Generator[Feed, torch.Tensor, Proposal]] = [
        drafter.draft(row, row, Offer(drafter, length), length)  # type: ignore[arg-type]
        for row, length in zip(rows, lengths, strict=True)]

    def on_forward(batch: PackedBatch, seconds: float) -> None:
        assert seconds >= 0
        forwards.append([shape.num_tokens for shape in batch.shapes])

    return run_to_end(model.model, rounds, on_forward)  # type: ignore[attr-defined]


def test_rounds_of_different_lengths_packed_give_what_each_gives_alone() -> None:
    model, caches = draft_caches()
    lengths = [1, 4, 2]
    alone = []
    for cache, prompt, length in zip(caches, PROMPTS, lengths, strict=True):
        copy = cache.clone()
        alone.append(drafts(model, [Row(copy, prompt[-1:])], [length], [])[0].token_ids)
    forwards: list[list[int]] = []
    together = drafts(model, [Row(cache, prompt[-1:]) for cache, prompt in zip(caches, PROMPTS, strict=True)],
                      lengths, forwards)
    assert [proposal.token_ids for proposal in together] == alone
    assert [len(tokens) for tokens in alone] == lengths
    # One forward per draft position, packing every round still drafting: the first feeds each row's pending
    # token, the rest the last draft of the rows that want more.
    assert forwards == [[1, 1, 1], [1, 1], [1], [1]]
    assert [proposal.num_fed for proposal in together] == [1, 4, 2]
