"""Lossless speculative decoding (VeriCache): draft from a compressed cache, verify with the full one.

The same model drafts tokens from the KV cache a compressor produced, then one forward over the drafts
on the full cache verifies them. Accepted drafts plus the full model's own next token are emitted;
both caches roll back to the accepted length, and the exact KV of the accepted tokens, computed by the
verify forward, replaces the drafter's own in the compressed cache. Greedy output is therefore the
full model's greedy output, and sampling (rejection sampling) follows the full model's distribution.
"""

from __future__ import annotations

import torch

from kvlab.cache import KVCache
from kvlab.cache.tiers import move_to_tier
from kvlab.errors import ConfigError
from kvlab.generation.config import GenerationConfig
from kvlab.generation.outputs import ProgressCallback, TokenCallback
from kvlab.generation.prefill import check_prompts, prefill
from kvlab.generation.sampling import select_next_tokens
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.remote_prefix import admit_remote
from kvlab.lossless.run import LosslessRun, new_sequence
from kvlab.lossless.stats import LosslessOutput
from kvlab.models import LoadedModel
from kvlab.store.prefix import PrefixSource
from kvlab.store.resolution import exact_resolutions

# The verifier's cache is only ever restored from bit-exact chunks, whatever else the store allows.
EXACT = exact_resolutions()


def generate_lossless(
    loaded: LoadedModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    lossless: LosslessConfig,
    on_progress: ProgressCallback | None = None,
    prefix: PrefixSource | None = None,
    on_tokens: TokenCallback | None = None,
) -> LosslessOutput:
    """Generate with a compressed-cache drafter and full-cache verification.

    Greedy output equals `kvlab.generation.generate` with the full cache (float32); with sampling the
    tokens follow the full model's distribution.

    Args:
        loaded: Model from `kvlab.models.load_model`.
        prompts: Token ids per prompt (lengths may differ; each row keeps its own rounds).
        config: Decoding settings (greedy when temperature is 0) and the full KV's tier.
        lossless: Drafter, draft length, schedule.
        on_progress: Called after each emission with the number of tokens emitted.
        prefix: Restore stored prompt prefixes (into the full and the draft cache; bit-exact chunks
            only, so output stays identical) and save new ones.
        on_tokens: Called with each request's tokens as they are emitted (streaming).
    """
    check_prompts(loaded, prompts, config.max_new_tokens)
    if lossless.prefix_draft is not None and prefix is None:
        raise ConfigError("drafting from a low-bit prefix (prefix_draft) needs a prefix store")
    run = LosslessRun(loaded, config, lossless, len(prompts), prefix, on_progress, on_tokens)
    for request, prompt in enumerate(prompts):
        if lossless.prefix_draft is not None and prefix is not None and admit_remote(run, request, prompt, prefix):
            continue
        admit_prefilled(run, request, prompt)
    while run.sequences:
        run.step()
    return run.finish()


def admit_prefilled(
    run: LosslessRun,
    request: int,
    prompt: list[int],
    prefilled: tuple[KVCache, KVCache | None, torch.Tensor] | None = None,
) -> None:
    """Prefill `prompt` into a full and a draft cache, emit its first token and add it to `run`.

    Args:
        prefilled: The prompt's full cache, draft cache and [1, V] last logits, when already computed
            (`kvlab.generation.prefill.prefill` with the request's drafter; the caches are consumed).
            A draft cache of None admits a sequence that decodes without drafting (plain decoding, or
            lossy decoding when the first cache is compressed).
    """
    capacity = run.capacity(prompt, request)
    if prefilled is None:
        full, draft, logits = prefill(
            run.loaded,
            [prompt],
            capacity,
            drafter=run.settings[request].drafter,
            prefix=run.prefix,
            stats=run.stats,
            prefix_resolutions=EXACT,
            chunk_tokens=run.configs[request].prefill_chunk_tokens,
        )
        assert draft is not None
    else:
        full, draft, logits = prefilled
    first_token = int(select_next_tokens(logits, run.configs[request], run.generators[request])[0])
    if not full.compressed:  # a compressed cache is the small one that stays in fast memory
        full = move_to_tier(full, run.loader, capacity)
    draft_missing = 0 if draft is None else 1
    run.admit(new_sequence(run, request, prompt, full, draft, [first_token], draft_missing), [first_token])
