"""The lossless run: every sequence's rounds, advanced together one forward at a time.

Each tick packs the draft segments of sequences that are drafting and the verify segments of
sequences whose drafts are in into one forward (two when the drafter has its own weights): the
weights are read once for all of them, and every segment attends over its own cache. A sequence
that rejects early starts its next round at once; none waits for the others, and none drafts more
than its own round asks for.

A run also serves as a server's continuous batch: requests join between ticks (`add_request`, each
with its own sampling settings, generator and drafter), sequences without a draft cache decode plainly
(or lossily) in the same packed forwards, and `cancel`/`release` drop a request and its caches.
"""

from __future__ import annotations

import torch

from kvlab.cache import KVCache, Segment, run_packed
from kvlab.cache.tiers import TierLoader, request_loads
from kvlab.generation.config import GenerationConfig
from kvlab.generation.outputs import (
    GenerationStats,
    ProgressCallback,
    RequestOutput,
    TokenCallback,
    collect_requests,
    finish_timing,
)
from kvlab.generation.rows import batch_rows, stop_checker
from kvlab.generation.sampling import draw_tokens, sampling_generator, select_next_tokens
from kvlab.lossless.acceptance import accept_drafts
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.draft_length import StepCosts
from kvlab.lossless.sequence import Sequence
from kvlab.lossless.stats import LosslessOutput, LosslessStats
from kvlab.models import LoadedModel
from kvlab.models.draft_weights import draft_model
from kvlab.store.prefix import PrefixSource
from kvlab.timing import Stopwatch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


class LosslessRun:
    """Model, settings, sampling generator, statistics and the sequences being decoded.

    Attributes:
        sequences: Sequences still generating, in admission order.
        rows: Generated tokens and stop reasons per request.
        costs: Measured per-segment forward costs, shared by every sequence's draft-length controller.
        configs, generators, settings: Each request's decoding settings, sampling generator and lossless
            settings (the run's own for the first `num_requests`, which share its generator).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        config: GenerationConfig,
        lossless: LosslessConfig,
        num_requests: int,
        prefix: PrefixSource | None = None,
        on_progress: ProgressCallback | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.lossless = lossless
        self.prefix = prefix
        self.on_progress = on_progress
        self.clock = Stopwatch(loaded.device)
        self.generator = sampling_generator(config, loaded.device)
        self.rows = batch_rows(loaded, config, num_requests, on_tokens)
        self.stats = GenerationStats()
        self.lossless_stats = LosslessStats()
        self.costs = StepCosts()
        self.loader = TierLoader(config.tier)
        self.stats.tier = config.tier.name
        self.drafter = draft_model(loaded.model, lossless.draft_weights)
        self.sequences: list[Sequence] = []
        self.prompts: list[list[int]] = [[] for _ in range(num_requests)]
        self.num_admitted = 0
        self.configs: list[GenerationConfig] = [config] * num_requests
        self.generators: list[torch.Generator | None] = [self.generator] * num_requests
        self.settings: list[LosslessConfig] = [lossless] * num_requests

    def add_request(self, config: GenerationConfig, lossless: LosslessConfig | None = None) -> int:
        """A new request with its own settings and seeded generator; returns its index (admit it next)."""
        generator = sampling_generator(config, self.loaded.device)  # may raise: before any state changes
        request = self.rows.add(stop_checker(self.loaded, config))
        self.prompts.append([])
        self.configs.append(config)
        self.generators.append(generator)
        self.settings.append(lossless or self.lossless)
        return request

    def capacity(self, prompt: list[int], request: int | None = None) -> int:
        """Tokens a sequence's caches must hold: prompt, new tokens and one round's drafts."""
        config = self.config if request is None else self.configs[request]
        settings = self.lossless if request is None else self.settings[request]
        return len(prompt) + config.max_new_tokens + settings.max_num_draft_tokens + 2

    def admit(self, sequence: Sequence, first_tokens: list[int]) -> None:
        """Add a prefilled sequence (its first emitted tokens, if any, are recorded now)."""
        self.prompts[sequence.request] = sequence.prompt
        self.num_admitted += 1
        self.stats.prompt_tokens += len(sequence.prompt)
        if first_tokens:
            self._emit(sequence, first_tokens)
        if self.rows.reasons[sequence.request] is None:
            self.sequences.append(sequence)
            self._start_round(sequence)
        self._record_drafts(sequence)

    def cancel(self, request: int) -> None:
        """Stop a request now: its sequence leaves the run (its caches are freed) and it is released."""
        self.sequences = [s for s in self.sequences if s.request != request]
        self.release(request)

    def release(self, request: int) -> None:
        """Forget a stopped request's prompt, tokens and generator once its output has been read."""
        self.prompts[request] = []
        self.generators[request] = None
        self.rows.release(request)

    def output(self, request: int) -> RequestOutput:
        """What `request` produced so far (its text cut before a stop string)."""
        tokens = self.rows.generated[request]
        text = self.rows.checkers[request].final_text(self.loaded.decode(tokens))
        return RequestOutput(self.prompts[request], list(tokens), text, self.rows.reason(request))

    def step(self) -> None:
        """One tick: draw what can be drawn, then one packed forward (two with separate draft weights)."""
        drafting: list[Sequence] = []
        verifying: list[Sequence] = []
        for sequence in self.sequences:
            self._draw(sequence)
            (verifying if sequence.ready_to_verify else drafting).append(sequence)
        for sequence in verifying:
            if sequence.land_prefix is not None:
                sequence.land_prefix()
                sequence.land_prefix = None
            if self.lossless.schedule == "synchronous":
                assert sequence.full is not None
                request_loads(sequence.full)
        if self.drafter is self.loaded.model:
            self._forward(self.loaded.model, drafting, verifying)
        else:
            self._forward(self.drafter, drafting, [])
            self._forward(self.loaded.model, [], verifying)
        if verifying:  # draft caches only grow by the exact KV a verify hands them
            self._record_drafts()
        self.sequences = [s for s in self.sequences if self.rows.reasons[s.request] is None]

    def _record_drafts(self, admitted: Sequence | None = None) -> None:
        drafts = [s.draft for s in self.sequences if s.draft is not None]
        if not drafts and admitted is not None and admitted.draft is not None:
            drafts = [admitted.draft]
        if drafts:
            self.stats.record_caches(drafts)

    def finish(self) -> LosslessOutput:
        """The output once every sequence has stopped."""
        self.stats.record_tier(self.loader.stats)
        self.lossless_stats.kv_load_s += self.loader.stats.wait_s
        finish_timing(self.stats, self.clock.elapsed(), self.num_admitted)
        requests = collect_requests(self.loaded, self.prompts, self.rows)
        return LosslessOutput(requests, self.stats, self.lossless_stats)

    def _forward(self, model: torch.nn.Module, drafting: list[Sequence], verifying: list[Sequence]) -> None:
        if not drafting and not verifying:
            return
        segments, token_ids, logits_at, start = [], [], [], 0
        for sequence in drafting:
            assert sequence.draft is not None
            feed = sequence.draft_feed()
            segments.append(Segment(sequence.draft, len(feed)))
            token_ids.append(feed)
            start += len(feed)
            logits_at.append(start - 1)
        captures: list[LayerKV | None] = []
        for sequence in verifying:
            feed = sequence.verify_feed()
            assert sequence.full is not None
            # Only a draft cache needs the verified tokens' exact KV.
            captured: LayerKV | None = None if sequence.draft is None else []
            captures.append(captured)
            segments.append(Segment(sequence.full, len(feed), captured=captured))
            token_ids.append(feed)
            first = start + len(sequence.pending) - 1
            logits_at.extend(range(first, start + len(feed)))
            start += len(feed)
        clock = Stopwatch(self.loaded.device)
        logits = run_packed(model, segments, token_ids, logits_at)  # type: ignore[arg-type]
        seconds = clock.elapsed()
        self.costs.observe(seconds, len(drafting), len(verifying))
        if verifying:
            self.lossless_stats.verify_s += seconds
        else:
            self.lossless_stats.draft_s += seconds
        for index, sequence in enumerate(drafting):
            sequence.draft_fed += segments[index].num_tokens
            sequence.draft_logits = logits[index]
            self._draw(sequence)
        offset = len(drafting)
        for sequence, captured in zip(verifying, captures):
            count = len(sequence.draft_token_ids) + 1
            self.verify_and_rollback(sequence, logits[offset : offset + count], captured)
            offset += count

    def _draw(self, sequence: Sequence) -> None:
        """Draw the next draft token from logits already computed (draft_tokens' one step)."""
        if sequence.draft_logits is None or len(sequence.draft_token_ids) >= sequence.num_draft_tokens:
            return
        request = sequence.request
        token, distribution = draw_tokens(sequence.draft_logits[None], self.configs[request], self.generators[request])
        sequence.draft_token_ids.append(int(token[0]))
        if distribution is not None:
            sequence.draft_probs.append(distribution[0])
        sequence.draft_logits = None

    def verify_and_rollback(self, sequence: Sequence, target_logits: torch.Tensor, captured: LayerKV | None) -> None:
        """Accept drafts against the verify forward's [k + 1, V] logits, roll both caches back to the
        accepted length, emit the tokens and start the sequence's next round.

        The full cache keeps the pending tokens and the accepted drafts; the draft cache drops what it
        was fed this round and takes the exact KV of the same tokens from the verify forward instead.
        A sequence without a draft cache has no drafts: its next token is chosen from [1, V] logits
        exactly as plain decoding chooses it.
        """
        assert sequence.full is not None
        config, generator = self.configs[sequence.request], self.generators[sequence.request]
        if sequence.draft is None:
            next_token = select_next_tokens(target_logits, config, generator)
            sequence.pending = [int(next_token[0])]
            self._emit(sequence, sequence.pending)
            self._start_round(sequence)
            return
        num_draft = len(sequence.draft_token_ids)
        draft_ids = torch.tensor([sequence.draft_token_ids], dtype=torch.long, device=target_logits.device)
        draft_probs = None
        if not config.greedy:
            vocab = target_logits.shape[-1]
            stacked = torch.stack(sequence.draft_probs) if sequence.draft_probs else target_logits.new_empty(0, vocab)
            draft_probs = stacked[None]
        assert captured is not None
        num_accepted, next_token = accept_drafts(draft_ids, draft_probs, target_logits[None], config, generator)
        accepted = int(num_accepted[0])
        sequence.full.drop_last(num_draft - accepted)
        sequence.draft.set_provisional(False)
        sequence.draft.drop_last(sequence.draft_fed)
        begin = len(sequence.pending) - sequence.draft_missing
        end = len(sequence.pending) + accepted
        sequence.draft.append([(keys[:, :, begin:end], values[:, :, begin:end]) for keys, values in captured], [end - begin])
        self.lossless_stats.record_round(num_draft, accepted)
        sequence.stats.record_round(num_draft, accepted)
        sequence.controller.update(num_draft, accepted)
        sequence.pending = [int(next_token[0])]
        sequence.draft_missing = 1
        self._emit(sequence, sequence.draft_token_ids[:accepted] + sequence.pending)
        self._start_round(sequence)

    def _start_round(self, sequence: Sequence) -> None:
        if self.rows.reasons[sequence.request] is not None:
            return
        if sequence.draft is None:
            return
        remaining = self.rows.checkers[sequence.request].max_new_tokens - len(self.rows.generated[sequence.request])
        wanted = sequence.controller.next_num_draft_tokens()
        sequence.num_draft_tokens = max(min(wanted, remaining - 1), 0)
        sequence.draft_token_ids, sequence.draft_probs, sequence.draft_fed = [], [], 0
        sequence.draft.set_provisional(True)
        if self.lossless.schedule == "staggered" and sequence.full is not None:
            request_loads(sequence.full)

    def _emit(self, sequence: Sequence, tokens: list[int]) -> None:
        emitted = self.rows.emit(sequence.request, tokens)
        self.stats.new_tokens += emitted
        everyone_admitted = self.num_admitted == len(self.rows.generated)
        if not self.stats.ttft_s and everyone_admitted and all(self.rows.generated):
            self.stats.ttft_s = self.clock.elapsed()
        if self.on_progress is not None:
            self.on_progress(emitted)


def new_sequence(
    run: LosslessRun,
    request: int,
    prompt: list[int],
    full: KVCache | None,
    draft: KVCache | None,
    pending: list[int],
    draft_missing: int,
) -> Sequence:
    """A sequence of `run` with its own draft-length controller (from its request's settings)."""
    controller = run.settings[request].controller(run.costs)
    return Sequence(request, prompt, full, draft, controller, pending, draft_missing)
