"""The engine: the continuous batch every request runs through, plain, lossy or lossless.

`add_request` queues a request; each `step` admits what fits, prefills (a piece, or whole prompts),
then runs one tick (`kvlab.engine.tick`): every running sequence's next feed, packed into one forward
per set of weights. Lossless sequences draft and verify on their own schedules (`kvlab.lossless.round`),
each round planned by the scheduler's planner (`kvlab.lossless.planner`); plain and lossy ones take
one token per tick (`kvlab.generation.feed`). The run's figures are kept in `kvlab.engine.figures`.
A failure in one request's work fails that request alone (stop reason "error"); a failing forward fails
the sequences it carried. The engine is not thread-safe: one thread drives it (a server wraps it in queues).
"""

from __future__ import annotations

import torch

from kvlab.cache import KVCache
from kvlab.cache.tiers import TierLoader, TierSpec, move_to_tier
from kvlab.engine.config import EngineCallbacks, EngineConfig
from kvlab.engine.figures import RunFigures
from kvlab.engine.prefixes import PrefixFetcher, PrefixSources
from kvlab.engine.request import PrefilledPrompt, Request
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence, Status
from kvlab.engine.tick import Decoder
from kvlab.errors import ConfigError
from kvlab.generation.feed import Rounds, plain_rounds
from kvlab.generation.logprobs import TokenLogprobs
from kvlab.generation.outputs import GenerationStats, RequestOutput
from kvlab.generation.prefill import PrefillCaches, PrefixReuse, PromptPrefill, check_prompts
from kvlab.generation.sampling import sampling_generator, select_next_tokens
from kvlab.generation.stopping import StopChecker
from kvlab.lossless.calibration import CalibrationStore
from kvlab.lossless.config import warn_if_inexact
from kvlab.lossless.remote_prefix import PrefixTarget, start_remote
from kvlab.lossless.round import LosslessState, lossless_rounds
from kvlab.lossless.stats import LosslessStats
from kvlab.models import LoadedModel, forward_kind
from kvlab.models.draft_weights import draft_model
from kvlab.store.resolution import exact_resolutions

# The verifier's cache is only ever restored from bit-exact chunks, whatever else the store allows.
EXACT = exact_resolutions()


class Engine:
    """Continuous batching over one model (see the module docstring).

    Public API: `add_request`, `step`, `cancel`, `output`, `error`, `release`, `round_stats`,
    `reused_tokens`, the counts (`num_unfinished`, `num_running`, `num_fetching`, `has_work`),
    `finish_stats` and `close`; `stats` and `lossless_stats` hold the figures of every request so far,
    `planner` the rounds' planner and its fitted cost model.
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
        self.figures = RunFigures(loaded.device, self.config.aggregate_stats, self.callbacks)
        self.scheduler = Scheduler(self.config.max_num_seqs, self.config.interleave_prefill)
        self.planner = self.scheduler.planner
        self._sequences: dict[int, Sequence] = {}
        self._next_id = 0
        self._loaders: dict[TierSpec, TierLoader] = {}
        self._weight_sets: dict[str, torch.nn.Module] = {"same": loaded.model}  # type: ignore[dict-item]
        calibration = CalibrationStore.for_model(loaded.source, loaded.dtype, loaded.device, forward_kind(loaded.model))
        self._decoder = Decoder(loaded.model, self._weight_sets, self.planner, self.figures,  # type: ignore[arg-type]
                                self._loaders, calibration, loaded.architecture.num_kv_groups)
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
        sequence = Sequence(self._next_id, request, generator, checker, self.figures.on_emit, prefilled=prefilled)
        if request.config.logprobs is not None:
            sequence.logprobs = TokenLogprobs()
        self._next_id += 1
        self.figures.num_added += 1
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

    @property
    def stats(self) -> GenerationStats:
        return self.figures.stats

    @property
    def lossless_stats(self) -> LosslessStats:
        return self.figures.lossless_stats

    def finish_stats(self) -> tuple[GenerationStats, LosslessStats]:
        """The figures of every request so far, with the tiers' loads, the cost model's fit and the timing
        completed."""
        return self.figures.finish(list(self._loaders.values()), self.planner)

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
            reuse = PrefixReuse(self.prefixes.get(request.cache_salt), resolutions, fetched, self.figures.records())
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
            self._calibrate(request.lossless.draft_weights, cache, prefilled.draft, first_token)
            sequence.lossless = LosslessState(cache, prefilled.draft, request.lossless, self.planner,
                                              pending=[first_token], draft_missing=1, totals=self.figures.totals())
        else:
            sequence.cache = cache
        going_on = sequence.emit([first_token])
        rounds: Rounds | None = None
        if going_on:
            rounds = self._rounds(sequence, first_token)
        sequence.start(rounds)
        self.figures.record_caches(self.scheduler.running)
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
            self.loaded, self.prefixes.get(request.cache_salt), loader, self.figures.records() or GenerationStats(),
            self.figures.totals(),
        )
        started = start_remote(
            target, self._drafter(settings.draft_weights), request.prompt, settings, request.capacity
        )
        if started is None:
            return False
        self.stats.tier = request.config.tier.name
        self._admitted(sequence)
        # The exact prefix is in transit: the served weights are calibrated on the draft cache meanwhile.
        self._calibrate(settings.draft_weights, started.draft, started.draft, request.prompt[-1])
        sequence.lossless = LosslessState(started.exact, started.draft, settings, self.planner, pending=[],
                                          draft_missing=0, totals=self.figures.totals(),
                                          draft_logits=started.draft_logits)
        sequence.start(lossless_rounds(sequence, sequence.lossless))
        self.figures.record_caches(self.scheduler.running)
        return True

    def _calibrate(self, weights: str, full: KVCache, draft: KVCache, token_id: int) -> None:
        """Fit the planner's cost model to the served and draft weights where it has not been yet."""
        self._drafter(weights)
        self._decoder.calibrate(weights, full, draft, token_id)

    def _admitted(self, sequence: Sequence) -> None:
        self.scheduler.start_running(sequence)
        self.figures.admitted(sequence)

    # ----- decoding

    def _decode(self, finished: list[Sequence]) -> None:
        """One tick (`kvlab.engine.tick`), then the stopped sequences finish."""
        running = list(self.scheduler.running)
        stopped, verified = self._decoder.tick(running, lambda sequence, error: self._fail(sequence, error, finished))
        if verified or stopped:  # draft caches only grow by the exact KV a verify hands them
            self.figures.record_caches([s for s in running if s.status is Status.RUNNING])
        for sequence in stopped:
            self._finish(sequence, finished)

    # ----- bookkeeping

    def _finish(self, sequence: Sequence, finished: list[Sequence]) -> None:
        self.scheduler.remove(sequence)
        sequence.status = Status.FINISHED
        sequence.release_caches()
        finished.append(sequence)

    def _fail(self, sequence: Sequence, error: BaseException, finished: list[Sequence]) -> None:
        if sequence.status is not Status.FINISHED:
            sequence.error, sequence.stop_reason = error, sequence.stop_reason or "error"  # a stop rule's stays
            self._finish(sequence, finished)

    def _loader(self, spec: TierSpec) -> TierLoader:
        if spec not in self._loaders:
            self._loaders[spec] = TierLoader(spec)
        return self._loaders[spec]

    def _drafter(self, weights: str) -> torch.nn.Module:
        if weights not in self._weight_sets:
            self._weight_sets[weights] = draft_model(self.loaded.model, weights)  # type: ignore[arg-type]
        return self._weight_sets[weights]
