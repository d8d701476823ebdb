"""Plain autoregressive generation on kvlab's cache: prefill, then one token per step.

The decode loop allocates each row's cache once (prompt + max_new_tokens), so no step copies the
cache; finished rows leave the batch so the others do not pay for them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvlab.cache import ForwardStep, KVCache, PairedPrefillStep, forward, run_step
from kvlab.compress import Compressor
from kvlab.errors import ConfigError
from kvlab.generation.config import GenerationConfig
from kvlab.generation.rows import BatchRows
from kvlab.generation.sampling import select_next_tokens
from kvlab.generation.stopping import StopChecker, StopReason
from kvlab.models import LoadedModel
from kvlab.store.prefix import FetchStats, PrefixSource
from kvlab.timing import Stopwatch

if TYPE_CHECKING:
    from kvlab.lossless.stats import SpecStats

ProgressCallback = Callable[[int], None]
"""Called after every decode step with the number of tokens that step produced (across rows)."""


@dataclasses.dataclass(slots=True)
class GenerationStats:
    """Timings and sizes of one `generate` call (a batch shares them).

    Attributes:
        prompt_tokens: Tokens prefilled, all rows together.
        new_tokens: Tokens generated, all rows together.
        ttft_s: Seconds from the call to the first generated token of every row (prefill included).
        decode_s: Seconds from the first token to the last.
        decode_tokens_per_s: Tokens generated after the first ones, per second of decoding.
        kv_bytes: Bytes of the KV representation at its largest (full-precision parts counted in fp16).
        kv_bytes_ratio: What the same tokens take uncompressed in fp16, divided by `kv_bytes`.
        kv_resident_bytes: Bytes of KV tensors held in memory at the largest, working copies included.
        prefix_reused_tokens: Prompt tokens whose KV came from a prefix store instead of the model.
        prefix_fetches: One record per prompt fetched from a prefix store.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    kv_bytes: int = 0
    kv_bytes_ratio: float = 1.0
    kv_resident_bytes: int = 0
    prefix_reused_tokens: int = 0
    prefix_fetches: list[FetchStats] = dataclasses.field(default_factory=list)

    def record_cache(self, cache: KVCache) -> None:
        """Update the KV size figures from the cache's current contents, keeping the largest."""
        stored = cache.nbytes()
        if stored >= self.kv_bytes:
            self.kv_bytes = stored
            self.kv_bytes_ratio = cache.full_nbytes() / stored if stored else 1.0
        self.kv_resident_bytes = max(self.kv_resident_bytes, cache.resident_bytes())


@dataclasses.dataclass(slots=True)
class RequestOutput:
    """What one prompt of a batch produced.

    Attributes:
        prompt_token_ids: Exactly the ids the model was fed.
        token_ids: Generated ids, including a final end-of-sequence token when generation hit one.
        text: Decoded `token_ids` without special tokens, cut before a stop string.
        stop_reason: "eos", "stop_string" or "length".
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    stop_reason: StopReason


@dataclasses.dataclass(slots=True)
class GenerationOutput:
    """Outputs of a batch; `spec` holds draft/verify statistics when generation was speculative."""

    requests: list[RequestOutput]
    stats: GenerationStats
    spec: SpecStats | None = None


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


def generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    on_progress: ProgressCallback | None = None,
    compressor: Compressor | None = None,
    prefix: PrefixSource | None = None,
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
    """
    check_prompts(loaded, prompts, config.max_new_tokens)
    stopwatch = Stopwatch(loaded.device)
    generator = None if config.greedy else torch.Generator(loaded.device).manual_seed(config.seed)
    checker = StopChecker(
        loaded.eos_token_ids, config.stop_strings, config.max_new_tokens, loaded.decode, config.ignore_eos
    )
    capacity = max(len(p) for p in prompts) + config.max_new_tokens
    stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
    cache, _, logits = prefill(
        loaded, prompts, capacity, compressor, prefix=prefix, stats=stats, chunk_tokens=config.prefill_chunk_tokens
    )
    stats.record_cache(cache)
    rows = BatchRows(len(prompts), checker)
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
        logits = forward(loaded.model, cache, next_tokens[:, None], logits_to_keep=1)[:, -1]
    stats.record_cache(cache)
    finish_timing(stats, stopwatch.elapsed(), len(prompts))
    return GenerationOutput(collect_requests(loaded, prompts, rows), stats)


def collect_requests(loaded: LoadedModel, prompts: list[list[int]], rows: BatchRows) -> list[RequestOutput]:
    """The per-request outputs once every row has stopped."""
    return [
        RequestOutput(prompt, tokens, rows.checker.final_text(loaded.decode(tokens)), rows.reason(request))
        for request, (prompt, tokens) in enumerate(zip(prompts, rows.generated))
    ]


def finish_timing(stats: GenerationStats, total_s: float, num_rows: int) -> None:
    stats.decode_s = total_s - stats.ttft_s
    decoded_after_first = stats.new_tokens - num_rows
    stats.decode_tokens_per_s = decoded_after_first / stats.decode_s if stats.decode_s > 0 else 0.0
