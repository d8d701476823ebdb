"""Lossless speculative decoding (VeriCache): draft from a compressed cache, verify with the full one.

The same model drafts k tokens from the KV cache a compressor produced, then one forward over the k
drafts on the full cache verifies them. Accepted drafts plus the full model's own next token are
emitted; both caches roll back to the accepted length, and the exact KV of the accepted tokens,
computed by the verify pass, replaces the drafter's own in the compressed cache. Greedy output is
therefore the full model's greedy output, and sampling (rejection sampling) follows the full model's
distribution.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from transformers import PreTrainedModel

from kvlab.cache import ForwardStep, KVCache, forward, run_step
from kvlab.cache.tiers import TIERS, BackgroundLoader, Tier, move_to_disk, prefetch
from kvlab.compress import Compressor
from kvlab.errors import ConfigError
from kvlab.generation.config import GenerationConfig
from kvlab.generation.engine import (
    GenerationOutput,
    GenerationStats,
    ProgressCallback,
    check_prompts,
    collect_requests,
    finish_timing,
    prefill,
)
from kvlab.generation.rows import BatchRows
from kvlab.generation.sampling import draw_tokens, select_next_tokens
from kvlab.generation.stopping import StopChecker
from kvlab.models import LoadedModel
from kvlab.models.draft_weights import DRAFT_WEIGHTS, DraftWeights, draft_model
from kvlab.lossless.acceptance import accept_drafts
from kvlab.lossless.draft_length import DraftLengthController
from kvlab.lossless.remote_prefix import RemoteStart, remote_prefix_start
from kvlab.lossless.stats import SpecStats
from kvlab.store.prefix import PrefixSource
from kvlab.store.resolution import exact_resolutions, get_resolution
from kvlab.timing import Stopwatch

# The verifier's cache is only ever restored from bit-exact chunks, whatever else the store allows.
EXACT = exact_resolutions()


@dataclasses.dataclass(frozen=True, slots=True)
class SpecConfig:
    """How to draft and verify.

    Attributes:
        drafter: The compressor whose cache drafts (any registered method).
        draft_length: Tokens drafted per round, or "auto" to adapt to measured acceptance and costs.
        max_draft_length: Upper bound of adaptive draft lengths.
        full_kv_tier: Where the verifier's full KV lives: "memory", or "disk" (memory-mapped files).
        schedule: "staggered" loads the full KV in the background while drafting; "synchronous"
            drafts, then loads, then verifies.
        draft_weights: "same" drafts with the model itself (the paper's setting); "int8" drafts with an
            int8-weight copy, cheaper per step on a CPU (verification always uses the exact model).
        prefix_draft: With a prefix store: fetch the prefix at this low-bit resolution first and draft
            from it while the bit-exact prefix transfers (`kvlab.lossless.remote_prefix`); None fetches
            only the exact prefix.
        prefix_draft_chunks: Low-bit chunks the drafter gets: the first one (attention sinks) and the
            last ones, so the extra transfer stays small (None: every stored chunk).
    """

    drafter: Compressor
    draft_length: int | Literal["auto"] = "auto"
    max_draft_length: int = 64
    full_kv_tier: Tier = "memory"
    schedule: Literal["staggered", "synchronous"] = "staggered"
    draft_weights: DraftWeights = "same"
    prefix_draft: str | None = None
    prefix_draft_chunks: int | None = 4

    def __post_init__(self) -> None:
        if self.draft_length != "auto" and (not isinstance(self.draft_length, int) or self.draft_length < 1):
            raise ConfigError(f"draft length must be a positive integer or 'auto', got {self.draft_length!r}")
        if self.max_draft_length < 1:
            raise ConfigError(f"max_draft_length must be at least 1, got {self.max_draft_length}")
        if self.full_kv_tier not in TIERS:
            raise ConfigError(f"full KV tier must be one of {', '.join(TIERS)}, got {self.full_kv_tier!r}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise ConfigError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {self.draft_weights!r}")
        if self.prefix_draft is not None and get_resolution(self.prefix_draft).exact:
            raise ConfigError(f"prefix_draft is the low-bit resolution to draft from, not {self.prefix_draft!r}: use int8 or int4")
        if self.prefix_draft_chunks is not None and self.prefix_draft_chunks < 1:
            raise ConfigError(f"prefix_draft_chunks must be at least 1 or None, got {self.prefix_draft_chunks}")
        if self.schedule not in ("staggered", "synchronous"):
            raise ConfigError(f"schedule must be 'staggered' or 'synchronous', got {self.schedule!r}")

    def controller(self) -> DraftLengthController:
        fixed = None if self.draft_length == "auto" else int(self.draft_length)
        return DraftLengthController(fixed=fixed, max_length=self.max_draft_length)


@dataclasses.dataclass(slots=True)
class _Round:
    """One draft/verify round of the whole batch."""

    draft_token_ids: torch.Tensor  # [B, k] int64
    draft_probs: torch.Tensor | None  # [B, k, V] float32 when sampling
    num_accepted: list[int]  # per row, 0..k
    next_token_ids: torch.Tensor  # [B] int64, correction or bonus token


def generate_lossless(
    loaded: LoadedModel,
    prompts: list[list[int]],
    config: GenerationConfig,
    spec: SpecConfig,
    on_progress: ProgressCallback | None = None,
    prefix: PrefixSource | None = None,
) -> GenerationOutput:
    """Generate with a compressed-cache drafter and full-cache verification.

    Greedy output equals `kvlab.generation.generate` with the full cache (float32); with sampling the
    tokens follow the full model's distribution.

    Args:
        loaded: Model from `kvlab.models.load_model`.
        prompts: Token ids per prompt.
        config: Decoding settings (greedy when temperature is 0).
        spec: Drafter and draft length.
        on_progress: Called after each round with the number of tokens emitted.
        prefix: Restore stored prompt prefixes (into the full and the draft cache; bit-exact chunks
            only, so output stays identical) and save new ones.
    """
    check_prompts(loaded, prompts, config.max_new_tokens)
    stopwatch = Stopwatch(loaded.device)
    generator = None if config.greedy else torch.Generator(loaded.device).manual_seed(config.seed)
    checker = StopChecker(loaded.eos_token_ids, config.stop_strings, config.max_new_tokens, loaded.decode, config.ignore_eos)
    controller = spec.controller()
    capacity = max(len(p) for p in prompts) + config.max_new_tokens + spec.max_draft_length + 2
    stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
    spec_stats = SpecStats()
    if spec.prefix_draft is None:
        full, draft, logits = prefill(
            loaded, prompts, capacity, drafter=spec.drafter, prefix=prefix, stats=stats, prefix_resolutions=EXACT,
            chunk_tokens=config.prefill_chunk_tokens,
        )
        assert draft is not None
        last_tokens = select_next_tokens(logits, config, generator)
        first_tokens = [[token] for token in last_tokens.tolist()]
    else:
        if prefix is None:
            raise ConfigError("drafting from a low-bit prefix (prefix_draft) needs a prefix store")
        full, draft, first_tokens, last_tokens = _start_from_store(
            loaded, prompts, capacity, prefix, spec, config, generator, stats, spec_stats, controller.next_length()
        )
    if spec.full_kv_tier == "disk":
        full = move_to_disk(full)
    stats.record_cache(draft)
    rows = BatchRows(len(prompts), checker)
    emitted = sum(rows.emit(row, tokens) for row, tokens in enumerate(first_tokens))
    stats.ttft_s = stopwatch.elapsed()
    stats.new_tokens += emitted
    _report(on_progress, emitted)
    while True:
        keep = rows.running_rows()
        if not keep:
            break
        if len(keep) < len(rows.active):
            for cache in (full, draft):
                cache.select_rows(keep)
            rows.keep(keep)
            last_tokens = last_tokens[keep]
        num_draft = min(controller.next_length(), max(rows.remaining(row) for row in range(len(rows.active))) - 1)
        round_ = _draft_and_verify(
            loaded, full, draft, last_tokens, max(num_draft, 0), config, generator, controller, spec, spec_stats
        )
        emitted = 0
        for row, accepted in enumerate(round_.num_accepted):
            tokens = round_.draft_token_ids[row, :accepted].tolist() + [int(round_.next_token_ids[row])]
            emitted += rows.emit(row, tokens)
        stats.new_tokens += emitted
        stats.record_cache(draft)
        _report(on_progress, emitted)
        last_tokens = round_.next_token_ids
    finish_timing(stats, stopwatch.elapsed(), len(prompts))
    return GenerationOutput(collect_requests(loaded, prompts, rows), stats, spec_stats)


def _start_from_store(
    loaded: LoadedModel,
    prompts: list[list[int]],
    capacity: int,
    prefix: PrefixSource,
    spec: SpecConfig,
    config: GenerationConfig,
    generator: torch.Generator | None,
    stats: GenerationStats,
    spec_stats: SpecStats,
    max_drafts: int,
) -> tuple[KVCache, KVCache, list[list[int]], torch.Tensor]:
    """First verified round of each prompt, drafting from its low-bit prefix while the exact one arrives
    (a prompt with no low-bit prefix stored is prefilled as usual)."""
    fulls, drafts, first_tokens, last_tokens = [], [], [], []
    for prompt in prompts:
        start = remote_prefix_start(
            loaded, prompt, capacity, prefix, spec, config, generator, stats, spec_stats, max_drafts
        )
        if start is None:
            full, draft, logits = prefill(
                loaded, [prompt], capacity, drafter=spec.drafter, prefix=prefix, stats=stats, prefix_resolutions=EXACT,
                chunk_tokens=config.prefill_chunk_tokens,
            )
            assert draft is not None
            token = select_next_tokens(logits, config, generator)
            start = RemoteStart(full, draft, token.tolist(), token)
        fulls.append(start.full)
        drafts.append(start.draft)
        first_tokens.append(start.emitted)
        last_tokens.append(start.next_token)
    if len(prompts) == 1:
        return fulls[0], drafts[0], first_tokens, last_tokens[0]
    return KVCache.stack(fulls, capacity), KVCache.stack(drafts, capacity), first_tokens, torch.cat(last_tokens)


def _draft_and_verify(
    loaded: LoadedModel,
    full: KVCache,
    draft: KVCache,
    last_tokens: torch.Tensor,
    num_draft: int,
    config: GenerationConfig,
    generator: torch.Generator | None,
    controller: DraftLengthController,
    spec: SpecConfig,
    spec_stats: SpecStats,
) -> _Round:
    """Draft `num_draft` tokens per row, verify them in one pass, roll both caches to the accepted length."""
    on_disk = spec.full_kv_tier == "disk"
    loader = BackgroundLoader(full) if on_disk and spec.schedule == "staggered" else None
    draft_clock = Stopwatch(loaded.device)
    drafter = draft_model(loaded.model, spec.draft_weights)
    draft_token_ids, draft_probs = _draft(drafter, draft, last_tokens, num_draft, config, generator)
    draft_s = draft_clock.elapsed()
    if loader is not None:
        spec_stats.kv_load_s += loader.wait()
    elif on_disk:
        load_clock = Stopwatch(loaded.device)
        prefetch(full)
        spec_stats.kv_load_s += load_clock.elapsed()
    verify_clock = Stopwatch(loaded.device)
    verify_ids = torch.cat([last_tokens[:, None], draft_token_ids], dim=1)
    step = ForwardStep(full, full.next_positions(num_draft + 1, loaded.device), captured=[])
    target_logits = run_step(loaded.model, step, verify_ids)
    num_accepted, next_token_ids = accept_drafts(draft_token_ids, draft_probs, target_logits, config, generator)
    accepted = num_accepted.tolist()
    # The full cache keeps last token + accepted drafts; the draft cache drops everything it drafted and
    # takes the exact KV of the same tokens from the verify pass instead.
    full.drop_last([num_draft - n for n in accepted])
    draft.drop_last(num_draft)
    assert step.captured is not None
    draft.append(step.captured, [n + 1 for n in accepted])
    verify_s = verify_clock.elapsed()
    spec_stats.draft_s += draft_s
    spec_stats.verify_s += verify_s
    spec_stats.record_round(num_draft, accepted)
    controller.update(num_draft, accepted, draft_s, verify_s)
    return _Round(draft_token_ids, draft_probs, accepted, next_token_ids)


def _draft(
    model: PreTrainedModel,
    draft: KVCache,
    last_tokens: torch.Tensor,
    num_draft: int,
    config: GenerationConfig,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode `num_draft` tokens per row from the compressed cache (provisionally appended).

    Returns:
        ([B, k] int64 drafts, [B, k, V] float32 draft distributions when sampling, else None).
    """
    tokens, probs = [], []
    current = last_tokens
    with draft.provisional():
        for _ in range(num_draft):
            logits = forward(model, draft, current[:, None], logits_to_keep=1)[:, -1]
            current, distribution = draw_tokens(logits, config, generator)
            tokens.append(current)
            if distribution is not None:
                probs.append(distribution)
    batch = last_tokens.shape[0]
    draft_token_ids = torch.stack(tokens, dim=1) if tokens else last_tokens.new_empty(batch, 0)
    if config.greedy:
        return draft_token_ids, None
    if probs:
        return draft_token_ids, torch.stack(probs, dim=1)
    return draft_token_ids, torch.empty(batch, 0, model.config.vocab_size)


def _report(on_progress: ProgressCallback | None, count: int) -> None:
    if on_progress is not None:
        on_progress(count)
