"""The plain reference decoder: prefill, then one token per step on a stacked batch cache.

This is the oracle the equality tests compare against (lossless decoding, the engine, prefix reuse):
it shares no scheduling, packing or round logic with `kvlab.engine`. Each row's cache is allocated once
(prompt + max_new_tokens), so no step copies the cache; finished rows leave the batch.
"""

from __future__ import annotations

import torch

from kvlab.cache import KVCache, forward
from kvlab.cache.tiers import TierLoader, move_to_tier, request_loads
from kvlab.compress import Compressor
from kvlab.generation.config import GenerationConfig
from kvlab.generation.outputs import GenerationOutput, GenerationStats, RequestOutput, finish_timing
from kvlab.generation.prefill import PrefillCaches, PrefixReuse, check_prompts, prefill
from kvlab.generation.sampling import sampling_generator, select_next_tokens, suppress_stop_tokens
from kvlab.generation.stopping import StopChecker, StopReason
from kvlab.models import LoadedModel
from kvlab.store.prefix import PrefixSource
from kvlab.timing import Stopwatch


def reference_generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    compressor: Compressor | None = None,
    prefix: PrefixSource | None = None,
) -> GenerationOutput:
    """Continue each prompt from the full KV cache (or `compressor`'s), one batched forward per token.

    Greedy output is token-identical to transformers' `generate(do_sample=False)`. Sampling draws
    every row's token from one generator seeded by `config.seed`, [B, V] at a time.
    """
    check_prompts(loaded, prompts, config.max_new_tokens)
    stopwatch = Stopwatch(loaded.device)
    capacity = max(len(p) for p in prompts) + config.max_new_tokens
    stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
    reuse = None if prefix is None else PrefixReuse(prefix, stats=stats)
    cache, _, logits = prefill(loaded, prompts, PrefillCaches(capacity, compressor), reuse, config.prefill_chunk_tokens)
    return reference_decode(loaded, prompts, cache, logits, config, stats, stopwatch)


def reference_decode(
    loaded: LoadedModel,
    prompts: list[list[int]],
    cache: KVCache,
    logits: torch.Tensor,
    config: GenerationConfig,
    stats: GenerationStats | None = None,
    stopwatch: Stopwatch | None = None,
) -> GenerationOutput:
    """The decode loop of `reference_generate`, from prefilled caches (so one prefill can serve several runs).

    Args:
        cache: The prompts' prefilled KV, one row per prompt (it is consumed).
        logits: [B, V] logits of each prompt's last position.
        stats: Figures gathered so far (prefill); a new record when None.
        stopwatch: Started when the request arrived (TTFT counts from it); now when None.
    """
    stopwatch = stopwatch or Stopwatch(loaded.device)
    stats = stats or GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
    generator = sampling_generator(config, loaded.device)
    stats.record_cache(cache)
    loader = TierLoader(config.tier)
    if not cache.compressed:  # a compressed cache is the small one that stays in fast memory
        cache = move_to_tier(cache, loader, max(cache.seq_lengths) + config.max_new_tokens)
        stats.tier = config.tier.name
    checker = StopChecker(config, loaded.eos_token_ids, loaded.decode)
    generated: list[list[int]] = [[] for _ in prompts]
    reasons: list[StopReason | None] = [None] * len(prompts)
    active = list(range(len(prompts)))  # the request of each row still in the batch
    while True:
        num_generated = len(generated[active[0]])  # every row in the batch has generated as many
        logits = suppress_stop_tokens(logits, num_generated, config, checker.ending_token_ids)
        next_tokens = select_next_tokens(logits, config, generator)
        for request, token in zip(active, next_tokens.tolist(), strict=True):
            generated[request].append(token)
            reasons[request] = checker.check(generated[request])
        if stats.new_tokens == 0:
            stats.ttft_s = stopwatch.elapsed()
        stats.new_tokens += len(active)
        keep = [row for row, request in enumerate(active) if reasons[request] is None]
        if not keep:
            break
        if len(keep) < len(active):
            stats.record_cache(cache)
            cache.select_rows(keep)
            active = [active[row] for row in keep]
            next_tokens = next_tokens[keep]
        request_loads(cache)
        logits = forward(loaded.model, cache, next_tokens[:, None], logits_to_keep=1)[:, -1]
    stats.record_cache(cache)
    stats.record_tier(loader.stats)
    finish_timing(stats, stopwatch.elapsed(), len(prompts))
    outputs = [
        RequestOutput(prompt, tokens, checker.final_text(loaded.decode(tokens)), reason or "length")
        for prompt, tokens, reason in zip(prompts, generated, reasons, strict=True)
    ]
    return GenerationOutput(outputs, stats)
