"""The engine: the continuous batch every request runs through, plain, lossy or lossless.

`add_request` queues a request; each `step` admits what fits, prefills (a piece, or whole prompts),
then runs one tick: every running sequence's next feed, packed into one forward per set of weights
(`kvlab.engine.runner`). Lossless sequences draft and verify on their own schedules
(`kvlab.lossless.round`); plain and lossy ones take one token per tick (`kvlab.generation.feed`).
A failure in one request's work fails that request alone (stop reason "error"); a failing forward fails
the sequences it carried. The engine is not thread-safe: one thread drives it (a server wraps it in queues).
"""

from __future__ import annotations

import torch

from kvlab.cache import KVCache
from kvlab.cache.tiers import TierLoader, TierSpec, move_to_tier
from kvlab.engine.config import EngineCallbacks, EngineConfig
from kvlab.engine.prefixes import PrefixFetcher, PrefixSources
from kvlab.engine.request import PrefilledPrompt, Request
from kvlab.engine.runner import group_by_model, pack, run_batch
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence, Status
from kvlab.errors import ConfigError
from kvlab.generation.feed import Rounds, plain_rounds
from kvlab.generation.logprobs import TokenLogprobs
from kvlab.generation.outputs import GenerationStats, RequestOutput, finish_timing
from kvlab.generation.prefill import PrefillCaches, PrefixReuse, PromptPrefill, check_prompts
from kvlab.generation.sampling import sampling_generator, select_next_tokens
from kvlab.generation.stopping import StopChecker
from kvlab.lossless.config import warn_if_inexact
from kvlab.lossless.draft_length import StepCosts
from kvlab.lossless.gate import DraftingGate
from kvlab.lossless.remote_prefix import PrefixTarget, start_remote
from kvlab.lossless.round import LosslessState, lossless_rounds
from kvlab.lossless.stats import LosslessStats
from kvlab.models import LoadedModel
from kvlab.models.draft_weights import draft_model
from kvlab.store.resolution import exact_resolutions
from kvlab.timing import Stopwatch

# The verifier's cache is only ever restored from bit-exact chunks, whatever else the store allows.
EXACT = exact_resolutions()


class Engine:
    """Continuous batching over one model (see the module docstring).

    Public API: `add_request`, `step`, `cancel`, `output`, `error`, `release`, `round_stats`,
    `reused_tokens`, the counts (`num_unfinished`, `num_running`, `num_fetching`, `has_work`),
    `finish_stats` and `close`; `stats` and `lossless_stats` hold the figures of every request so far.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        prefixes: PrefixSources | None = None,
        callbacks: EngineCallbacks | None = None,
    ) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.prefixes = prefixes
        self.callbacks = callbacks or EngineCallbacks()
        self.stats = GenerationStats()
        self.lossless_stats = LosslessStats()
        self.costs = StepCosts()  # shared by every sequence's draft-length controller
        self.gate = DraftingGate(self.config.drafting_gate)  # the run's timed verdict on drafting
        self.scheduler = Scheduler(self.config.max_num_seqs, self.config.interleave_prefill)
        self.clock = Stopwatch(loaded.device)
        self._sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self._num_admitted = 0
        self._num_emitting = 0
        self._loaders: dict[TierSpec, TierLoader] = {}
        self._drafters: dict[str, torch.nn.Module] = {}
        self._fetcher = None
        if prefixes is not None and self.config.fetch_workers > 0:
            self._fetcher = PrefixFetcher(prefixes, self.config.fetch_workers)

    # ----- the public API

    def add_request(self, request: Request, prefilled: PrefilledPrompt | None = None) -> int:
        """Queue `request` (with its prompt already `prefilled`, its caches are consumed); returns its id.

        Raises:
            ConfigError: The prompt does not fit the model, or a setting cannot be honoured.
        """
        check_prompts(self.loaded, [request.prompt], request.config.max_new_tokens)
        lossless = request.lossless
        if lossless is not None and lossless.prefix_draft is not None and self.prefixes is None:
            raise ConfigError("drafting from a low-bit prefix (prefix_draft) needs a prefix store")
        if lossless is not None and prefilled is not None and prefilled.draft is None:
            raise ConfigError("a lossless request needs its prompt's draft cache prefilled too (PrefilledPrompt.draft)")
        # Everything that may raise comes before any state changes.
        generator = sampling_generator(request.config, self.loaded.device)
        if lossless is not None:
            self._drafter(lossless.draft_weights)
            warn_if_inexact(self.loaded.dtype)
        checker = StopChecker(request.config, self.loaded.eos_token_ids, self.loaded.decode)
        sequence = Sequence(self._next_id, request, generator, checker, self._on_emit, prefilled=prefilled)
        if request.config.logprobs is not None:
            sequence.logprobs = TokenLogprobs()
        self._next_id += 1
        if self._fetcher is not None and prefilled is None and request.reuses_prefixes:
            # A lossless verifier's cache is only ever restored from bit-exact chunks.
            resolutions = EXACT if lossless is not None else None
            sequence.fetch = self._fetcher.submit(
                request.cache_salt, request.prompt, resolutions, self.callbacks.on_fetched
            )
        self._sequences[sequence.id] = sequence
        self.scheduler.add(sequence)
        return sequence.id

    def step(self) -> list[int]:
        """Admit, prefill, then one decoding tick; returns the ids of requests that stopped or failed."""
        finished: list[Sequence] = []
        self.scheduler.admit()
        for sequence in self.scheduler.to_prefill():
            self._prefill(sequence, finished)
        if self.scheduler.running:
            self._decode(finished)
        return [sequence.id for sequence in finished]

    def cancel(self, request_id: int) -> None:
        """Stop a request now; its caches are freed and its output says "cancelled"."""
        sequence = self._sequences[request_id]
        if sequence.status is not Status.FINISHED:
            if sequence.fetch is not None:
                sequence.fetch.cancel()
            sequence.stop_reason = "cancelled"
            self._finish(sequence, [])

    def output(self, request_id: int) -> RequestOutput:
        """What the request produced so far (its text cut before a stop string; a failed one names its failure)."""
        sequence = self._sequences[request_id]
        text = sequence.checker.final_text(self.loaded.decode(sequence.token_ids, sequence.config.skip_special_tokens))
        return RequestOutput(sequence.request.prompt, list(sequence.token_ids), text, sequence.stop_reason or "length",
                             sequence.logprobs, sequence.prompt_logprobs, sequence.failure)

    def error(self, request_id: int) -> BaseException | None:
        """What failed the request (the exception itself), or None."""
        return self._sequences[request_id].error

    def round_stats(self, request_id: int) -> LosslessStats | None:
        """The request's own lossless rounds, updated as it decodes (None for plain and lossy requests)."""
        return self._sequences[request_id].round_stats

    def reused_tokens(self, request_id: int) -> int:
        """Prompt tokens of the request restored from a prefix store instead of computed."""
        return self._sequences[request_id].reused_tokens

    def sequence(self, request_id: int) -> Sequence:
        """The request's sequence, to inspect its caches and round state (the engine owns it: read only)."""
        return self._sequences[request_id]

    def release(self, request_id: int) -> None:
        """Forget a stopped request (after its output was read)."""
        if self._sequences[request_id].status is not Status.FINISHED:
            raise ValueError(f"request {request_id} has not stopped: cancel it first")
        del self._sequences[request_id]

    def num_unfinished(self) -> int:
        return len(self.scheduler)

    def num_running(self) -> int:
        """Requests prefilling or decoding."""
        return len(self.scheduler.prefilling) + len(self.scheduler.running)

    def num_fetching(self) -> int:
        """Requests whose prefix is still being fetched in the background."""
        return sum(not sequence.ready for sequence in self.scheduler.waiting)

    def has_work(self) -> bool:
        """A `step` would do something now (not only wait for background fetches)."""
        return bool(self.scheduler.running or self.scheduler.prefilling) or any(
            sequence.ready for sequence in self.scheduler.waiting
        )

    def finish_stats(self) -> tuple[GenerationStats, LosslessStats]:
        """The figures of every request so far, with the tiers' loads and the timing completed."""
        bytes_read = sum(loader.stats.bytes_read for loader in self._loaders.values())
        wait_s = sum(loader.stats.wait_s for loader in self._loaders.values())
        self.stats.tier_bytes_read, self.stats.tier_wait_s = bytes_read, wait_s
        self.lossless_stats.kv_load_s += wait_s
        self.lossless_stats.drafting_closed_ticks = self.gate.num_closed_ticks
        self.lossless_stats.drafting_verdicts = list(self.gate.verdicts)
        finish_timing(self.stats, self.clock.elapsed(), self._num_admitted)
        return self.stats, self.lossless_stats

    def close(self) -> None:
        """Stop the fetch workers (queued fetches are cancelled)."""
        if self._fetcher is not None:
            self._fetcher.close()

    # ----- prefill and admission

    def _prefill(self, sequence: Sequence, finished: list[Sequence]) -> None:
        """Prefill a piece of `sequence` (every piece offline); once done it starts decoding."""
        try:
            if sequence.prefilled is not None:
                self._start_decoding(sequence, sequence.prefilled, finished)
                return
            if sequence.prefill is None and self._start_from_remote_prefix(sequence):
                return
            if sequence.prefill is None:
                sequence.prefill = self._new_prefill(sequence)
                sequence.reused_tokens = sequence.prefill.reused_tokens
                if self.callbacks.on_prefill_started is not None:
                    self.callbacks.on_prefill_started(sequence.id)
            job = sequence.prefill
            while not job.done:
                if self.callbacks.on_prefill_piece is not None:
                    self.callbacks.on_prefill_piece(sequence.id, job.next_piece_tokens)
                job.step()
                if self.config.interleave_prefill and not job.done:
                    return
            assert job.logits is not None
            sequence.prompt_logprobs = job.prompt_logprobs
            self._start_decoding(
                sequence, PrefilledPrompt(job.cache, job.draft, job.logits, job.reused_tokens), finished
            )
        except Exception as error:  # one request's failure is that request's alone
            self._fail(sequence, error, finished)

    def _new_prefill(self, sequence: Sequence) -> PromptPrefill:
        request, lossless = sequence.request, sequence.request.lossless
        fetched = None if sequence.fetch is None else sequence.fetch.result()
        sequence.fetch = None
        caches = PrefillCaches(request.capacity, request.compressor, None if lossless is None else lossless.drafter)
        reuse = None
        if self.prefixes is not None and request.reuses_prefixes:
            resolutions = EXACT if lossless is not None else None
            reuse = PrefixReuse(self.prefixes.get(request.cache_salt), resolutions, fetched, self._records())
        return PromptPrefill(self.loaded, request.prompt, caches, reuse, request.config.prefill_chunk_tokens,
                             request.config.prompt_logprobs)

    def _start_decoding(self, sequence: Sequence, prefilled: PrefilledPrompt, finished: list[Sequence]) -> None:
        """The prefilled sequence's first token, then its rounds."""
        request = sequence.request
        sequence.prefilled, sequence.reused_tokens = None, prefilled.reused_tokens
        first_logits = sequence.choosing_logits(prefilled.logits)
        first_token = int(select_next_tokens(first_logits, request.config, sequence.generator)[0])
        cache: KVCache = prefilled.cache
        if not cache.compressed:  # a compressed cache is the small one that stays in fast memory
            cache = move_to_tier(cache, self._loader(request.config.tier), request.capacity)
            self.stats.tier = request.config.tier.name
        self._admitted(sequence)
        if request.lossless is not None:
            assert prefilled.draft is not None  # add_request refuses a lossless prompt prefilled without one
            sequence.lossless = LosslessState(
                cache, prefilled.draft, request.lossless, request.lossless.controller(self.costs, self.gate),
                pending=[first_token], draft_missing=1, totals=self._totals(), lookup=request.lossless.lookup_choice(),
            )
        else:
            sequence.cache = cache
        going_on = sequence.emit([first_token])
        rounds: Rounds | None = None
        if going_on:
            rounds = self._rounds(sequence, first_token)
        sequence.start(rounds)
        self._record_caches(self.scheduler.running)
        if not going_on:
            self._finish(sequence, finished)

    def _rounds(self, sequence: Sequence, first_token: int) -> Rounds:
        if sequence.lossless is not None:
            return lossless_rounds(sequence, sequence.lossless)
        assert sequence.cache is not None
        return plain_rounds(sequence, sequence.cache, first_token)

    def _start_from_remote_prefix(self, sequence: Sequence) -> bool:
        """A lossless request with `prefix_draft` drafts from its low-bit prefix while the exact one
        arrives (`kvlab.lossless.remote_prefix`); False when no low-bit chunk is stored."""
        request, settings = sequence.request, sequence.request.lossless
        if settings is None or settings.prefix_draft is None or self.prefixes is None or not request.reuses_prefixes:
            return False
        loader = self._loader(request.config.tier)
        target = PrefixTarget(
            self.loaded, self.prefixes.get(request.cache_salt), loader, self._records() or GenerationStats(),
            self._totals(),
        )
        started = start_remote(
            target, self._drafter(settings.draft_weights), request.prompt, settings, request.capacity
        )
        if started is None:
            return False
        self.stats.tier = request.config.tier.name
        self._admitted(sequence)
        controller = settings.controller(self.costs, self.gate)
        sequence.lossless = LosslessState(started.exact, started.draft, settings, controller,
                                          pending=[], draft_missing=0, totals=self._totals(),
                                          draft_logits=started.draft_logits, lookup=settings.lookup_choice())
        sequence.start(lossless_rounds(sequence, sequence.lossless))
        self._record_caches(self.scheduler.running)
        return True

    def _admitted(self, sequence: Sequence) -> None:
        self.scheduler.start_running(sequence)
        self._num_admitted += 1
        self.stats.prompt_tokens += len(sequence.request.prompt)

    # ----- decoding

    def _decode(self, finished: list[Sequence]) -> None:
        """One tick: every running sequence's feed, one packed forward per set of weights."""
        for sequence in list(self.scheduler.running):
            try:
                sequence.prime()
            except Exception as error:  # one request's failure is that request's alone
                self._fail(sequence, error, finished)
        running = list(self.scheduler.running)
        owners = {id(sequence.feed): sequence for sequence in running}
        feeds = [(self._model_for(sequence), sequence.feed) for sequence in running if sequence.feed is not None]
        lossless = any(sequence.lossless is not None for sequence in running)
        tick = self.gate.start_tick(self.stats.new_tokens, [feed for _, feed in feeds], self.loaded.device, lossless)
        lossless_verified = False
        for model, group in group_by_model(feeds, self.loaded.model):  # type: ignore[arg-type]
            batch = pack(model, group)
            try:
                logits, seconds = run_batch(batch, self.loaded.device)
            except Exception as error:  # the forward's sequences fail, the others go on
                for feed in batch.feeds:
                    self._fail(owners[id(feed)], error, finished)
                continue
            num_verifying = len(batch.feeds) - batch.num_drafting
            self.costs.observe(seconds, batch.num_drafting, [len(f.token_ids) for f in batch.feeds if not f.drafting])
            if num_verifying:
                self.lossless_stats.verify_s += seconds
            else:
                self.lossless_stats.draft_s += seconds
            for feed, feed_logits in zip(batch.feeds, logits, strict=True):
                sequence = owners[id(feed)]
                lossless_verified |= sequence.lossless is not None and not feed.drafting
                try:
                    sequence.advance(feed_logits)
                except Exception as error:  # one request's failure is that request's alone
                    self._fail(sequence, error, finished)
        if tick is not None:
            self.gate.observe(tick, self.stats.new_tokens)
        stopped = [sequence for sequence in running if sequence.status is Status.RUNNING and sequence.feed is None]
        if lossless_verified or stopped:  # draft caches only grow by the exact KV a verify hands them
            self._record_caches(running)
        for sequence in stopped:
            self._finish(sequence, finished)

    def _model_for(self, sequence: Sequence) -> torch.nn.Module:
        feed, lossless = sequence.feed, sequence.request.lossless
        if feed is not None and feed.drafting and lossless is not None:
            return self._drafter(lossless.draft_weights)
        return self.loaded.model

    # ----- bookkeeping

    def _on_emit(self, sequence: Sequence, token_ids: list[int]) -> None:
        if len(sequence.token_ids) == len(token_ids):
            self._num_emitting += 1
        self.stats.new_tokens += len(token_ids)
        everyone_started = self._num_emitting == self._num_admitted == self._next_id
        if not self.stats.ttft_s and everyone_started:
            self.stats.ttft_s = self.clock.elapsed()
        if self.callbacks.on_progress is not None:
            self.callbacks.on_progress(len(token_ids))
        if self.callbacks.on_tokens is not None and token_ids:
            self.callbacks.on_tokens(sequence.id, token_ids)

    def _record_caches(self, sequences: list[Sequence]) -> None:
        caches = [sequence.stored_cache for sequence in sequences if sequence.stored_cache is not None]
        if caches:
            self.stats.record_caches(caches)  # type: ignore[arg-type]

    def _finish(self, sequence: Sequence, finished: list[Sequence]) -> None:
        self.scheduler.remove(sequence)
        sequence.status = Status.FINISHED
        sequence.release_caches()
        finished.append(sequence)

    def _fail(self, sequence: Sequence, error: BaseException, finished: list[Sequence]) -> None:
        if sequence.status is not Status.FINISHED:
            sequence.error, sequence.stop_reason = error, sequence.stop_reason or "error"  # a stop rule's stays
            self._finish(sequence, finished)

    def _records(self) -> GenerationStats | None:
        """Where per-request records (prefix fetches) go: the engine's figures, or nowhere in a
        long-lived engine, whose figures would otherwise grow with every request it serves."""
        return self.stats if self.config.aggregate_stats else None

    def _totals(self) -> LosslessStats:
        """Where a sequence's rounds add up: the engine's figures, or a record that goes with the
        sequence in a long-lived engine (its per-round lists would grow without bound)."""
        return self.lossless_stats if self.config.aggregate_stats else LosslessStats()

    def _loader(self, spec: TierSpec) -> TierLoader:
        if spec not in self._loaders:
            self._loaders[spec] = TierLoader(spec)
        return self._loaders[spec]

    def _drafter(self, weights: str) -> torch.nn.Module:
        if weights not in self._drafters:
            self._drafters[weights] = draft_model(self.loaded.model, weights)  # type: ignore[arg-type]
        return self._drafters[weights]
