"""Prefill: each prompt on its own, optionally restored in part from a prefix store, then stacked.

`PromptPrefill` is one prompt's prefill cut into steps, for an engine that interleaves it with decoding.
`PrefillCaches` says which caches it fills, `PrefixReuse` what a prefix store restores and keeps.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from kvlab.cache import ForwardStep, KVCache, PairedPrefillStep, run_step
from kvlab.compress import Compressor
from kvlab.errors import ConfigError
from kvlab.generation.logprobs import TokenLogprobs, score_tokens
from kvlab.generation.outputs import GenerationStats
from kvlab.models import LoadedModel
from kvlab.store.prefix import FetchedPrefix, PrefixSource
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


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillCaches:
    """The caches a prompt's prefill fills.

    Attributes:
        capacity: Tokens each row must hold (prompt, new tokens, drafts).
        compressor: Compresses the prompt's cache after its last piece (lossy decoding); None keeps it full.
        drafter: Also fill a second cache that this compressor compresses (the draft cache of lossless
            decoding) from the same forwards; the first cache then stays full.
    """

    capacity: int
    compressor: Compressor | None = None
    drafter: Compressor | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixReuse:
    """A prefix store's part in a prefill: leading chunks restored from it, computed chunks saved to it.

    Attributes:
        source: The store.
        resolutions: Restore at these resolutions (None: the store's configured ones).
        fetched: The prompt's prefix, already fetched (e.g. in the background while others decoded);
            None fetches it at the start of the prefill.
        stats: Where restored tokens and fetch records are counted.
    """

    source: PrefixSource
    resolutions: tuple[str, ...] | None = None
    fetched: FetchedPrefix | None = None
    stats: GenerationStats | None = None


def prefill(
    loaded: LoadedModel,
    prompts: list[list[int]],
    caches: PrefillCaches,
    reuse: PrefixReuse | None = None,
    chunk_tokens: int | None = None,
) -> tuple[KVCache, KVCache | None, torch.Tensor]:
    """Prefill every prompt on its own (no padding), then stack the rows into one batch cache.

    The prompt's own attention is always exact. With `caches.compressor`, each layer compresses the
    prompt right after attending over it. With `caches.drafter`, the same forward also gives each
    layer's prompt KV to a second cache that the drafter compresses (the draft cache of lossless
    decoding). With `reuse`, each prompt's leading chunks are restored from a prefix store first (into
    both caches) and the rest is computed chunk by chunk and saved.

    Prefill runs in forwards cut at multiples of `chunk_tokens` (the store's chunk size with `reuse`;
    one forward when None). Kernels pick their blocking by input length, so the same tokens computed
    in forwards of other lengths may differ in their last bits: cutting at fixed boundaries makes a
    chunk's KV the same whichever prompt computed it, and a restored chunk exactly what recomputing
    it gives. Compressors see the prompt once, after the last piece.

    Returns:
        The batch cache, the draft cache (None without a drafter), and [B, V] logits of each prompt's
        last position.
    """
    rows, drafts, last_logits = [], [], []
    for prompt in prompts:
        job = PromptPrefill(loaded, prompt, caches, reuse, chunk_tokens)
        while not job.done:
            job.step()
        assert job.logits is not None
        last_logits.append(job.logits)
        rows.append(job.cache)
        if job.draft is not None:
            drafts.append(job.draft)
    draft_cache = _stack(drafts, caches.capacity) if drafts else None
    return _stack(rows, caches.capacity), draft_cache, torch.cat(last_logits)


class PromptPrefill:
    """One prompt's prefill, one piece per `step()`, so a server can decode other requests in between.

    The constructor allocates the prompt's cache (and draft cache with a drafter) and restores its
    stored prefix; each `step()` then computes the next piece (see `prefill` for how pieces are cut
    and why). Pieces are the same whether they run back to back or interleaved with other forwards.

    Attributes:
        cache: [1 row] the prompt's KV (compressed after the last piece with a compressor).
        draft: [1 row] the drafter's compressed copy, or None.
        logits: [1, V] logits of the prompt's last position, once `done`.
        reused_tokens: Prompt tokens restored from the store instead of computed.
        prompt_logprobs: With `prompt_logprobs` asked for, the scores of prompt tokens 1.. (each given
            the tokens before it), filled piece by piece (a piece's [q, V] logits are scored and dropped).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        prompt: list[int],
        caches: PrefillCaches,
        reuse: PrefixReuse | None = None,
        chunk_tokens: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        if prompt_logprobs is not None and reuse is not None:
            raise ConfigError("prompt log-probabilities need every position computed: prefill without a prefix store")
        prefix = None if reuse is None else reuse.source
        if prefix is not None:
            if chunk_tokens not in (None, prefix.chunk_tokens):
                raise ConfigError(
                    f"prefill chunks of {chunk_tokens} tokens do not match the prefix store's {prefix.chunk_tokens}"
                )
            chunk_tokens = prefix.chunk_tokens
        self.loaded = loaded
        self.prompt = prompt
        self.compressor = caches.compressor
        self.prefix = prefix
        allocate = functools.partial(
            KVCache.allocate, loaded.architecture, 1, caches.capacity, loaded.dtype, loaded.device
        )
        self.cache = allocate(caches.compressor)
        self.draft = None if caches.drafter is None else allocate(caches.drafter)
        self.reused_tokens = 0
        if reuse is not None:
            fetched = reuse.fetched if reuse.fetched is not None else reuse.source.fetch(prompt, reuse.resolutions)
            self.reused_tokens = _restore_prefix(fetched, [self.cache, self.draft], loaded.device, reuse.stats)
        self.pieces = prefill_pieces(self.reused_tokens, len(prompt), chunk_tokens)
        self.logits: torch.Tensor | None = None
        self.num_top_logprobs = prompt_logprobs
        self.prompt_logprobs = None if prompt_logprobs is None else TokenLogprobs()

    @property
    def done(self) -> bool:
        return not self.pieces

    @property
    def next_piece_tokens(self) -> int:
        """Tokens the next `step()` computes (0 when done)."""
        return self.pieces[0][1] - self.pieces[0][0] if self.pieces else 0

    def step(self) -> None:
        """Compute the next piece of the prompt (the last one also yields `logits`)."""
        begin, end = self.pieces.pop(0)
        last = not self.pieces
        cache, draft, loaded = self.cache, self.draft, self.loaded
        positions = cache.next_positions(end - begin, loaded.device)
        captured: list[tuple[torch.Tensor, torch.Tensor]] | None = None if self.prefix is None else []
        step: ForwardStep
        if draft is None:
            step = ForwardStep(cache, positions, compress=self.compressor is not None and last, captured=captured)
        else:
            step = PairedPrefillStep(cache, positions, captured=captured, draft_cache=draft, compress_draft=last)
        input_ids = torch.tensor([self.prompt[begin:end]], device=loaded.device)
        clock = Stopwatch(loaded.device)
        scoring = self.prompt_logprobs is not None
        all_logits = run_step(loaded.model, step, input_ids, logits_to_keep=0 if scoring else 1)
        logits = all_logits[:, -1]
        if self.prompt_logprobs is not None and self.num_top_logprobs is not None:
            # Row t of the piece predicts prompt token begin + t + 1; the last row of the prompt predicts
            # the first generated token, which is not the prompt's.
            next_ids = self.prompt[begin + 1 : end + 1]
            self.prompt_logprobs.extend(score_tokens(all_logits[0, : len(next_ids)], next_ids, self.num_top_logprobs))
        if draft is not None:
            draft.advance(end - begin)
        if self.prefix is not None and captured is not None:
            self.prefix.observe_prefill(end - begin, clock.elapsed())
            self.prefix.save(self.prompt, begin, captured)
        if last:
            self.logits = logits


def prefill_pieces(start: int, end: int, chunk_tokens: int | None) -> list[tuple[int, int]]:
    """Token ranges covering [start, end), cut at multiples of `chunk_tokens` (one range when None)."""
    if chunk_tokens is None:
        return [(start, end)]
    cuts = [start, *range((start // chunk_tokens + 1) * chunk_tokens, end, chunk_tokens), end]
    return list(itertools.pairwise(cuts))


def _restore_prefix(
    fetched: FetchedPrefix, caches: list[KVCache | None], device: torch.device, stats: GenerationStats | None
) -> int:
    """Append a prompt's fetched leading chunks to `caches`; returns how many tokens were restored."""
    for cache in caches:
        if cache is not None:
            fetched.restore_into(cache, device)
    if stats is not None:
        stats.prefix_reused_tokens += fetched.num_tokens
        stats.prefix_fetches.append(fetched.stats)
    return fetched.end


def _stack(caches: list[KVCache], capacity: int) -> KVCache:
    return caches[0] if len(caches) == 1 else KVCache.stack(caches, capacity)


