"""Offline front doors: a batch of prompts through one `Engine`, plain, lossy or lossless."""

from __future__ import annotations

from kvlab.compress import Compressor
from kvlab.engine.config import EngineCallbacks
from kvlab.engine.engine import Engine
from kvlab.engine.prefixes import SinglePrefixSource
from kvlab.engine.request import Request
from kvlab.generation.config import GenerationConfig
from kvlab.generation.outputs import GenerationOutput, GenerationStats, ProgressCallback, RequestOutput, TokenCallback
from kvlab.generation.prefill import check_prompts
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.stats import LosslessOutput, LosslessStats
from kvlab.models import LoadedModel
from kvlab.store.prefix import PrefixSource


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

    With the full cache, greedy output is token-identical to transformers' `generate(do_sample=False)`
    and to `kvlab.generation.reference_generate`. With a compressor, decoding reads only what the
    compressor stored (lossy). Each prompt samples from its own generator, seeded by `config.seed`.

    Args:
        loaded: Model from `kvlab.models.load_model`.
        prompts: Token ids per prompt (lengths may differ).
        config: Decoding settings.
        on_progress: Called with the number of tokens of each emission.
        compressor: Compress each prompt's KV after prefill and decode from it (None: full cache).
        prefix: Restore stored prompt prefixes and save new ones (see `kvlab.store.PrefixCache`);
            with bit-exact resolutions the output is identical to computing every prompt token.
        on_tokens: Called with (prompt index, tokens) as they are emitted (streaming).

    Raises:
        ConfigError: A prompt does not fit the model or a setting cannot be honoured (before any work).
        Exception: What failed a request, as it was raised, once the others have finished: a failed
            request never comes back looking like an answer (an `Engine` reports each request's
            outcome instead: stop reason "error" and the failure in its `RequestOutput`).
    """
    requests = [Request(prompt, config, compressor=compressor) for prompt in prompts]
    outputs, stats, _ = run_requests(loaded, requests, prefix, EngineCallbacks(on_tokens, on_progress))
    return GenerationOutput(outputs, stats)


def generate_lossless(
    loaded: LoadedModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    lossless: LosslessConfig,
    on_progress: ProgressCallback | None = None,
    prefix: PrefixSource | None = None,
    on_tokens: TokenCallback | None = None,
) -> LosslessOutput:
    """Generate with a compressed-cache drafter and full-cache verification (VeriCache).

    Greedy output equals `generate` with the full cache, token for token, when the model runs in
    float32; in bfloat16/float16 a verify forward over k tokens rounds differently from k single steps,
    so tokens may differ (logged once per process; see `kvlab.lossless.config.lossless_exact`). With
    sampling the tokens follow the full model's distribution.

    Args:
        loaded: Model from `kvlab.models.load_model`.
        prompts: Token ids per prompt (lengths may differ; each keeps its own rounds).
        config: Decoding settings (greedy when temperature is 0) and the full KV's tier.
        lossless: Drafter, draft length, schedule, draft weights, low-bit prefix drafting.
        on_progress: Called with the number of tokens of each emission.
        prefix: Restore stored prompt prefixes (into the full and the draft cache; bit-exact chunks
            only, so output stays identical) and save new ones.
        on_tokens: Called with (prompt index, tokens) as they are emitted (streaming).

    Raises:
        ConfigError: A prompt does not fit the model or a setting cannot be honoured (before any work).
        Exception: What failed a request, as it was raised, once the others have finished (see `generate`).
    """
    requests = [Request(prompt, config, lossless=lossless) for prompt in prompts]
    outputs, stats, rounds = run_requests(loaded, requests, prefix, EngineCallbacks(on_tokens, on_progress))
    return LosslessOutput(outputs, stats, rounds)


def run_requests(
    loaded: LoadedModel, requests: list[Request], prefix: PrefixSource | None, callbacks: EngineCallbacks
) -> tuple[list[RequestOutput], GenerationStats, LosslessStats]:
    """Decode `requests` together until every one stops; outputs in the given order.

    Raises:
        ConfigError: A prompt does not fit the model or a setting cannot be honoured (before any work).
        Exception: What failed a request (the first in the given order), re-raised as it was once the
            others have finished, so no failed request is returned as if it were an answer.
    """
    # Every prompt is checked before any work, named by its index in the batch.
    check_prompts(
        loaded, [request.prompt for request in requests], max((r.config.max_new_tokens for r in requests), default=1)
    )
    engine = Engine(loaded, prefixes=None if prefix is None else SinglePrefixSource(prefix), callbacks=callbacks)
    try:
        ids = [engine.add_request(request) for request in requests]
        while engine.num_unfinished():
            engine.step()
        for request_id in ids:
            error = engine.error(request_id)
            if error is not None:
                raise error
        outputs = [engine.output(request_id) for request_id in ids]
    finally:
        engine.close()
    stats, rounds = engine.finish_stats()
    return outputs, stats, rounds
