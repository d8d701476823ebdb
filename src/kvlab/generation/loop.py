"""Plain autoregressive generation on kvlab's cache: prefill, then one token per step.

The decode loop allocates each row's cache once (prompt + max_new_tokens), so no step copies the
cache; finished rows leave the batch so the others do not pay for them.
"""

from __future__ import annotations

import torch

from kvlab.cache import KVCache, forward
from kvlab.cache.tiers import TierLoader, move_to_tier, request_loads
from kvlab.compress import Compressor
from kvlab.generation.config import GenerationConfig
from kvlab.generation.outputs import (
    GenerationOutput,
    GenerationStats,
    ProgressCallback,
    TokenCallback,
    collect_requests,
    finish_timing,
)
from kvlab.generation.prefill import check_prompts, prefill
from kvlab.generation.rows import batch_rows
from kvlab.generation.sampling import sampling_generator, select_next_tokens
from kvlab.models import LoadedModel
from kvlab.store.prefix import PrefixSource
from kvlab.timing import Stopwatch


def generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    on_progress: ProgressCallback | None = None,
    compressor: Compressor | None = None,
    prefix: PrefixSource | None = None,
    on_tokens: TokenCallback | None = None,
) -> GenerationOutput:
    """Generate a continuation of each prompt, from the full KV cache or a compressed one.

    With the full cache, greedy output is token-identical to transformers' `generate(do_sample=False)`.
    With a compressor, decoding reads only what the compressor stored (lossy).

    Args:
        loaded: Model from `kvlab.models.load_model`.
        prompts: Token ids per prompt (lengths may differ).
        config: Decoding settings.
        on_progress: Optional callback, see `ProgressCallback`.
        compressor: Compress each prompt's KV after prefill and decode from it (None: full cache).
        prefix: Restore stored prompt prefixes and save new ones (see `kvlab.store.PrefixCache`);
            with bit-exact resolutions the output is identical to computing every prompt token.
        on_tokens: Called with each request's tokens as they are emitted (streaming).
    """
    check_prompts(loaded, prompts, config.max_new_tokens)
    stopwatch = Stopwatch(loaded.device)
    capacity = max(len(p) for p in prompts) + config.max_new_tokens
    stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
    cache, _, logits = prefill(
        loaded, prompts, capacity, compressor, prefix=prefix, stats=stats, chunk_tokens=config.prefill_chunk_tokens
    )
    return decode(loaded, prompts, cache, logits, config, on_progress, stats, stopwatch, on_tokens)


def decode(
    loaded: LoadedModel,
    prompts: list[list[int]],
    cache: KVCache,
    logits: torch.Tensor,
    config: GenerationConfig,
    on_progress: ProgressCallback | None = None,
    stats: GenerationStats | None = None,
    stopwatch: Stopwatch | None = None,
    on_tokens: TokenCallback | None = None,
) -> GenerationOutput:
    """The decode loop of `generate`, from prefilled caches (so one prefill can serve several runs).

    Args:
        cache: The prompts' prefilled KV, one row per prompt (it is consumed).
        logits: [B, V] logits of each prompt's last position.
        stats: Figures gathered so far (prefill); a new record when None.
        stopwatch: Started when the request arrived (TTFT counts from it); now when None.
        on_tokens: Called with each request's tokens as they are emitted (streaming).
    """
    stopwatch = stopwatch or Stopwatch(loaded.device)
    stats = stats or GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
    generator = sampling_generator(config, loaded.device)
    stats.record_cache(cache)
    loader = TierLoader(config.tier)
    if not cache.compressed:  # a compressed cache is the small one that stays in fast memory
        cache = move_to_tier(cache, loader, max(cache.seq_lengths) + config.max_new_tokens)
        stats.tier = config.tier.name
    rows = batch_rows(loaded, config, len(prompts), on_tokens)
    while True:
        next_tokens = select_next_tokens(logits, config, generator)
        for row, token in enumerate(next_tokens.tolist()):
            rows.emit(row, [token])
        if stats.new_tokens == 0:
            stats.ttft_s = stopwatch.elapsed()
        stats.new_tokens += len(rows.active)
        if on_progress is not None:
            on_progress(len(rows.active))
        keep = rows.running_rows()
        if not keep:
            break
        if len(keep) < len(rows.active):
            stats.record_cache(cache)
            cache.select_rows(keep)
            rows.keep(keep)
            next_tokens = next_tokens[keep]
        request_loads(cache)
        logits = forward(loaded.model, cache, next_tokens[:, None], logits_to_keep=1)[:, -1]
    stats.record_cache(cache)
    stats.record_tier(loader.stats)
    finish_timing(stats, stopwatch.elapsed(), len(prompts))
    return GenerationOutput(collect_requests(loaded, prompts, rows), stats)


