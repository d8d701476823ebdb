"""Prefill: each prompt on its own, optionally restored in part from a prefix store, then stacked."""

from __future__ import annotations

import itertools

import torch

from kvlab.cache import ForwardStep, KVCache, PairedPrefillStep, run_step
from kvlab.compress import Compressor
from kvlab.errors import ConfigError
from kvlab.generation.outputs import GenerationStats
from kvlab.models import LoadedModel
from kvlab.store.prefix import PrefixSource
from kvlab.timing import Stopwatch


def check_prompts(loaded: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Refuse prompts the model cannot continue: empty, or past its usable context."""
    if not prompts:
        raise ConfigError("no prompts given")
    limit = loaded.architecture.max_context
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ConfigError(f"prompt {index} is empty")
        if len(prompt) + max_new_tokens > limit:
            raise ConfigError(
                f"prompt {index} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} that exceeds the "
                f"model's context of {limit} tokens: shorten the prompt or lower --max-new-tokens"
            )


def prefill(
    loaded: LoadedModel,
    prompts: list[list[int]],
    capacity: int,
    compressor: Compressor | None = None,
    drafter: Compressor | None = None,
    prefix: PrefixSource | None = None,
    stats: GenerationStats | None = None,
    prefix_resolutions: tuple[str, ...] | None = None,
    chunk_tokens: int | None = None,
) -> tuple[KVCache, KVCache | None, torch.Tensor]:
    """Prefill every prompt on its own (no padding), then stack the rows into one batch cache.

    The prompt's own attention is always exact. With `compressor`, each layer compresses the prompt
    right after attending over it. With `drafter`, the same forward also gives each layer's prompt KV
    to a second cache that `drafter` compresses (the draft cache of lossless decoding); the first
    cache then stays full. With `prefix`, each prompt's leading chunks are restored from a prefix
    store first (into both caches, at `prefix_resolutions` or the store's configured ones) and the
    rest is computed chunk by chunk and saved.

    Prefill runs in forwards cut at multiples of `chunk_tokens` (the store's chunk size with `prefix`;
    one forward when None). Kernels pick their blocking by input length, so the same tokens computed
    in forwards of other lengths may differ in their last bits: cutting at fixed boundaries makes a
    chunk's KV the same whichever prompt computed it, and a restored chunk exactly what recomputing
    it gives. Compressors see the prompt once, after the last piece.

    Returns:
        The batch cache, the draft cache (None without `drafter`), and [B, V] logits of each prompt's
        last position.
    """
    if prefix is not None:
        if chunk_tokens not in (None, prefix.chunk_tokens):
            raise ConfigError(
                f"prefill chunks of {chunk_tokens} tokens do not match the prefix store's {prefix.chunk_tokens}"
            )
        chunk_tokens = prefix.chunk_tokens
    caches, drafts, last_logits = [], [], []
    for prompt in prompts:
        cache = KVCache.allocate(loaded.architecture, 1, capacity, loaded.dtype, loaded.device, compressor)
        draft = None
        if drafter is not None:
            draft = KVCache.allocate(loaded.architecture, 1, capacity, loaded.dtype, loaded.device, drafter)
            drafts.append(draft)
        start = 0
        if prefix is not None:
            start = _restore_prefix(prefix, prompt, [cache, draft], loaded.device, stats, prefix_resolutions)
        pieces = prefill_pieces(start, len(prompt), chunk_tokens)
        for index, (begin, end) in enumerate(pieces):
            last = index == len(pieces) - 1
            positions = cache.next_positions(end - begin, loaded.device)
            captured: list[tuple[torch.Tensor, torch.Tensor]] | None = None if prefix is None else []
            step: ForwardStep
            if draft is None:
                step = ForwardStep(cache, positions, compress=compressor is not None and last, captured=captured)
            else:
                step = PairedPrefillStep(cache, positions, captured=captured, draft_cache=draft, compress_draft=last)
            input_ids = torch.tensor([prompt[begin:end]], device=loaded.device)
            clock = Stopwatch(loaded.device)
            logits = run_step(loaded.model, step, input_ids, logits_to_keep=1)[:, -1]
            if draft is not None:
                draft.advance(end - begin)
            if prefix is not None and captured is not None:
                prefix.observe_prefill(end - begin, clock.elapsed())
                prefix.save(prompt, begin, captured)
        last_logits.append(logits)
        caches.append(cache)
    draft_cache = _stack(drafts, capacity) if drafts else None
    return _stack(caches, capacity), draft_cache, torch.cat(last_logits)


def prefill_pieces(start: int, end: int, chunk_tokens: int | None) -> list[tuple[int, int]]:
    """Token ranges covering [start, end), cut at multiples of `chunk_tokens` (one range when None)."""
    if chunk_tokens is None:
        return [(start, end)]
    cuts = [start, *range((start // chunk_tokens + 1) * chunk_tokens, end, chunk_tokens), end]
    return list(itertools.pairwise(cuts))


def _restore_prefix(
    prefix: PrefixSource,
    prompt: list[int],
    caches: list[KVCache | None],
    device: torch.device,
    stats: GenerationStats | None,
    resolutions: tuple[str, ...] | None,
) -> int:
    """Append a prompt's stored leading chunks to `caches`; returns how many tokens were restored."""
    fetched = prefix.fetch(prompt, resolutions)
    for cache in caches:
        if cache is not None:
            fetched.restore_into(cache, device)
    if stats is not None:
        stats.prefix_reused_tokens += fetched.num_tokens
        stats.prefix_fetches.append(fetched.stats)
    return fetched.end


def _stack(caches: list[KVCache], capacity: int) -> KVCache:
    return caches[0] if len(caches) == 1 else KVCache.stack(caches, capacity)


