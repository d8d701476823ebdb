"""`KVLabDraftProposer`: VeriCache self-drafting from a compressed KV cache, as a vLLM proposer.

vLLM (`speculative_config={"method": "custom_class", "model": "kvlab.integrations.vllm.KVLabDraftProposer"}`)
builds it with the engine's config, hands it the target model in `load_model`, and calls `propose`
every step with each batch row's token history. The proposer drafts `num_speculative_tokens` greedy
tokens per row from the same checkpoint running on a kvlab compressed cache; vLLM verifies them
with its full KV, so output is identical to plain decoding whatever the drafts are (greedy, in float32).

With `KVLabConnector` in the same engine (`kv_connector_extra_config` may be empty), each step's rows
come with their request ids and vLLM's pages (`kvlab.integrations.vllm.handover`):
- a request's draft cache is its prompt's KV read from the pages and compressed, made when a plan first
  drafts from that row's cache (a row served by prompt lookup or plain steps never pays for it); only the last
  `window` prompt tokens are computed again, for the compressor's observation window (SnapKV's
  queries) and as a check that the pages hold this prompt's KV (a mismatch falls back to the token
  path for that request, logged and counted). A compressor that scores with every prompt query
  (`observes_every_query`: H2O, query-agnostic SnapKV) has its prompts prefilled by the drafter;
- the tokens vLLM accepted reach the draft cache from the pages, not from a catch-up forward;
- draft caches are kept by request id and freed when vLLM says the request finished;
- the drafts are kvlab's own drafters' (`CompressedCacheDrafter`'s rounds, `PromptLookup`'s offers; the
  proposer only adapts a row to them: `DraftRow`), the rows' rounds packed (`kvlab.engine.runner`): one
  forward per draft position reads the weights once;
- each step, kvlab's planner chooses for every row together (`sources.py`): its prompt lookup's
  continuation (no forward, with an `ngram+<compressor>` drafter; judged by what matches of its n-gram length
  were accepted), a round from the compressed cache of
  the length that pays most (the rows drafting together split each draft forward, costed by kvlab's
  fitted cost model), or nothing, where no round is expected to beat the row's plain step.

Without the connector (or where it cannot hand over: several KV cache groups, an unmapped page
layout) the proposer says so once and works from token ids alone: it prefills each new sequence
itself, finds it again by token prefix (rows are reordered between steps) and feeds the accepted
tokens through the drafter.

vLLM's model module cannot attend over a kvlab cache, so the checkpoint is loaded a second time into
transformers modules with kvlab attention (docs/vllm.md). The drafter is any kvlab compressor, chosen
by `KVLAB_VLLM_DRAFTER` (JSON `{"name": ..., **params}`, default `{"name": "snapkv"}`), and the
weights it drafts with by `KVLAB_VLLM_DRAFT_WEIGHTS` (`same`, `bf16`, `int8` or `int4`: a copy whose
linear layers read a quarter or an eighth of the bytes on a CPU; default `same`): vLLM passes a custom
proposer nothing but its config. Prompts' windows and prefills always run with the served weights.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvlab.attention_kernels import warm_up_split_kv
from kvlab.compress import Compressor
from kvlab.engine import Feed, PackedBatch, pack, run_batch, run_to_end
from kvlab.errors import ConfigError
from kvlab.integrations.vllm.adoption import (
    DraftRow,
    DraftSequence,
    HandoverMismatch,
    ProposerStats,
    SequenceBuilder,
    synthetic_caches,
)
from kvlab.integrations.vllm.handover import BOARD, LayerKV, StepHandover, engine_key
from kvlab.integrations.vllm.model import served_model, transformers_model
from kvlab.integrations.vllm.settings import (
    DEFAULT_DRAFTER,
    DRAFT_LENGTH_ENV,
    DRAFT_WEIGHTS_ENV,
    DRAFTER_ENV,
    draft_length_from_environment,
    draft_weights_from_environment,
    drafter_from_environment,
)
from kvlab.integrations.vllm.sources import (
    CACHE,
    CALIBRATION_KEPT_TOKENS,
    CALIBRATION_ROWS,
    LOOKUP,
    LookupAcceptance,
    StepCosts,
    StepRows,
    fixed_plans,
    plan_rows,
)
from kvlab.lossless.compressed_cache import CompressedCacheDrafter
from kvlab.lossless.cost_model import SegmentShape
from kvlab.lossless.drafter import Offer
from kvlab.lossless.prompt_lookup import LookupMatch, PromptLookup, find_match
from kvlab.models import LoadedModel
from kvlab.models.draft_weights import DraftWeights, draft_model
from kvlab.timing import Stopwatch

__all__ = ["DEFAULT_DRAFTER", "DRAFTER_ENV", "DRAFT_LENGTH_ENV", "DRAFT_WEIGHTS_ENV", "DraftSequence",
           "KVLabDraftProposer", "ProposerStats", "draft_length_from_environment", "draft_weights_from_environment",
           "drafter_from_environment"]

logger = logging.getLogger(__name__)

# Sequences kept without being seen in a step when they are found by token prefix (no request ids):
# a preempted request that comes back finds its cache.
_MAX_IDLE_SEQUENCES = 8


class KVLabDraftProposer:
    """A vLLM `custom_class` proposer drafting with a kvlab compressed cache of the target checkpoint.

    Args:
        vllm_config: The engine's config (vLLM passes nothing else).
        drafter: The compressor whose cache drafts (default, with `lookup`: from `KVLAB_VLLM_DRAFTER`).
        draft_weights: The weights that draft (default: from `KVLAB_VLLM_DRAFT_WEIGHTS`).
        lookup: Prompt lookup composed with the compressed cache (with an explicit `drafter`).
        draft_length: `auto` or `fixed` (default: from `KVLAB_VLLM_DRAFT_LENGTH`).
    """

    def __init__(self, vllm_config: Any, drafter: Compressor | None = None,
                 draft_weights: DraftWeights | None = None, lookup: PromptLookup | None = None,
                 draft_length: str | None = None) -> None:
        self.num_speculative_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.directory, self.dtype = served_model(vllm_config)
        self.drafter, self.lookup = (drafter, lookup) if drafter is not None else drafter_from_environment()
        self.draft_weights = draft_weights or draft_weights_from_environment()
        self.draft_length = draft_length or draft_length_from_environment()
        self.engine = engine_key(vllm_config)
        self.model: LoadedModel | None = None
        self.by_request: dict[str, DraftSequence] = {}
        self.by_prefix: list[DraftSequence] = []
        self.untrusted: set[str] = set()
        self.stats = ProposerStats()
        self.costs = StepCosts(self.draft_weights)
        self.lookup_acceptance = LookupAcceptance()
        self._since_propose: Stopwatch | None = None
        # vLLM's next step, as the last call proposed it: its sequences and their segments (proposal + 1 tokens).
        self._proposed: tuple[list[DraftSequence], list[SegmentShape]] = ([], [])
        self._said_no_handover = False
        # Tokens the last adopted draft cache kept: what a row not adopted yet would draft over.
        self.kept_tokens: int | None = None

    def load_model(self, target_model: Any = None) -> None:
        """Load the served checkpoint for kvlab's attention (vLLM's module cannot use a kvlab cache)."""
        self.model = transformers_model(self.directory, self.dtype)
        draft_model(self.model.model, self.draft_weights)  # made once now, not in the first step
        architecture = self.model.architecture  # the draft attention's kernel too (built once per machine)
        warm_up_split_kv(architecture.num_kv_heads, architecture.num_kv_groups, architecture.head_dim)
        target_vocab = getattr(getattr(target_model, "config", None), "vocab_size", None)
        if target_vocab is not None and target_vocab != self.model.model.config.vocab_size:
            raise ConfigError(f"KVLabDraftProposer: the drafter's vocabulary ({self.model.model.config.vocab_size}) "
                              f"differs from the target's ({target_vocab})")

    @property
    def builder(self) -> SequenceBuilder:
        assert self.model is not None, "vLLM calls load_model before propose"
        return SequenceBuilder(self.model, self.drafter, self.stats, self.draft_weights)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft token ids per batch row (empty for rows still in prefill or at the length limit).

        Args:
            sampled_token_ids: Per row, the tokens vLLM accepted this step (empty: no draft wanted).
            num_tokens_no_spec: [num_rows] tokens of each row's history, the sampled ones included.
            token_ids_cpu: [max_rows, max_model_len] token ids of each row's history.
            slot_mappings: vLLM's KV slots (unused: the hand-over names each row's blocks).
        """
        if self._since_propose is None:
            self._calibrate_drafts()
        clock = Stopwatch(self.model.device if self.model is not None else "cpu")
        since_last_s = self._since_propose.elapsed() if self._since_propose is not None else None
        handover = self._take_handover()
        rows, histories, sequences = [], [], []
        for row, sampled in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[row])
            if not sampled or num_tokens + self.num_speculative_tokens >= self.max_model_len:
                continue
            history = np.asarray(token_ids_cpu[row, :num_tokens], dtype=np.int64)
            sequence = self._sequence_for(row, history, handover)
            sequence.sources.record(len(sampled))
            rows.append(row)
            histories.append(history)
            sequences.append(sequence)
        last_sequences, last_shapes = self._proposed
        decoding_only = all(sampled_token_ids) and len(sequences) == len(last_sequences) and all(
            sequence is last for sequence, last in zip(sequences, last_sequences, strict=True))
        if since_last_s is not None and decoding_only:
            # vLLM's step, measured only where it decoded the last call's sequences and nothing else: idle time
            # between requests and prefill (a new request's, or a chunk of one still prefilling: a row with no
            # sampled token) are not what a round costs.
            self.costs.observe_step(last_shapes, since_last_s)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for row, drafted in zip(rows, self._draft(sequences, histories, rows, handover), strict=True):
            drafts[row] = drafted
        self._proposed = (sequences, [SegmentShape(len(drafts[row]) + 1, len(history) - 1)
                                      for row, history in zip(rows, histories, strict=True)])
        if self.by_prefix:
            idle = [sequence for sequence in self.by_prefix if all(sequence is not s for s in sequences)]
            self.by_prefix = [s for s in sequences if s in self.by_prefix] + idle[:_MAX_IDLE_SEQUENCES]
        self.stats.num_calls += 1
        self.stats.total_s += clock.elapsed()
        self._since_propose = Stopwatch(self.model.device if self.model is not None else "cpu")
        return drafts

    def _calibrate_drafts(self) -> None:
        """Fit the draft forward on synthetic caches before the first plan (`StepCosts.calibrate_drafts`), so
        that no row is adopted only to time it. On the first call rather than in `load_model` (tried there
        before, docs/vllm-batches/load-calibration/): vLLM's worker has set its threads up by then."""
        if self.draft_length != "auto" or self.model is None or self.costs.forwards.ready(self.draft_weights):
            return
        drafts = draft_model(self.model.model, self.draft_weights)
        self.costs.calibrate_drafts(drafts, [synthetic_caches(self.model, kept, max(CALIBRATION_ROWS))
                                             for kept in CALIBRATION_KEPT_TOKENS])

    def _take_handover(self) -> StepHandover | None:
        """This step's hand-over (freeing the draft caches of finished requests), or None, said once."""
        handover = BOARD.take(self.engine)
        if handover is not None:
            for req_id in handover.finished:
                self.by_request.pop(req_id, None)
                self.untrusted.discard(req_id)
        elif not self._said_no_handover:
            self._said_no_handover = True
            reason = "it hands no KV over" if BOARD.connected(self.engine) else "the engine has no KVLabConnector"
            logger.warning("KVLabDraftProposer prefills each prompt itself and catches up on accepted tokens with "
                           "forwards: %s (see docs/vllm.md)", reason)
        return handover

    def _sequence_for(self, row: int, history: np.ndarray, handover: StepHandover | None) -> DraftSequence:
        """The row's draft cache, holding the KV of `history[:-1]` or fewer of its first tokens.

        A request whose hand-over failed a check once is served from token ids from then on."""
        req_id = self._handed_request(row, history, handover)
        if req_id is None:
            return self._by_token_prefix(history)
        assert handover is not None
        sequence = self.by_request.get(req_id)
        builder = self.builder
        try:
            if sequence is None:  # adopted when a plan first drafts from its cache (`_adopt`)
                sequence = DraftSequence(None, history[:0].copy(), req_id=req_id)
            elif sequence.cache is not None and not builder.extend(sequence, history, handover, row):
                sequence = builder.adopt(history, handover, row) or builder.prefill(history)
                sequence.req_id = req_id
        except HandoverMismatch as error:
            self._distrust(req_id, "hand-over KV", str(error))
            return self._by_token_prefix(history)
        self.by_request[req_id] = sequence
        return sequence

    def _adopt(self, sequence: DraftSequence, history: np.ndarray, handover: StepHandover,
               row: int) -> DraftSequence:
        """`sequence` with its draft cache of `history[:-1]` from row `row`'s pages (or its own prefill); where
        the pages fail the check, a sequence prefilled from token ids (the request is served from them on)."""
        assert sequence.req_id is not None
        try:
            built = self.builder.adopt(history, handover, row) or self.builder.prefill(history)
        except HandoverMismatch as error:
            self._distrust(sequence.req_id, "hand-over KV", str(error))
            return self._by_token_prefix(history)
        assert built.cache is not None
        sequence.cache, sequence.token_ids = built.cache, built.token_ids
        self.kept_tokens = built.cache.stored_tokens()
        return sequence

    def _handed_request(self, row: int, history: np.ndarray, handover: StepHandover | None) -> str | None:
        """The row's request when the hand-over names one it trusts whose pages hold `history[:-1]`."""
        if handover is None:
            return None
        handed = handover.rows[row] if row < len(handover.rows) else None
        if handed is None or handed.req_id is None:
            self.stats.count_fallback("hand-over row", f"row {row} of the hand-over names no request")
            return None
        if handed.req_id in self.untrusted:
            return None
        if not len(history) - 1 <= handed.num_tokens <= len(history) - 1 + self.num_speculative_tokens:
            self._distrust(handed.req_id, "hand-over row",
                           f"row {row} holds {handed.num_tokens} tokens' KV for a history of {len(history)}")
            return None
        return handed.req_id

    def _distrust(self, req_id: str, kind: str, detail: str) -> None:
        self.stats.count_fallback(kind, f"request {req_id}: {detail}")
        self.by_request.pop(req_id, None)
        self.untrusted.add(req_id)

    def _by_token_prefix(self, history: np.ndarray) -> DraftSequence:
        """Without request ids: the kept sequence whose tokens are the longest prefix of `history`, or a
        newly prefilled one."""
        best: DraftSequence | None = None
        for sequence in self.by_prefix:
            length = len(sequence.token_ids)
            if length < len(history) and (best is None or length > len(best.token_ids)) and \
                    np.array_equal(history[:length], sequence.token_ids):
                best = sequence
        if best is None:
            best = self.builder.prefill(history)
            self.by_prefix.append(best)
        return best

    def _draft(self, sequences: list[DraftSequence], histories: list[np.ndarray], batch_rows: list[int],
               handover: StepHandover | None) -> list[list[int]]:
        """Each row's drafts, as kvlab's planner chose them for the whole step (`sources.plan_rows`), from
        kvlab's drafters (prompt lookup's offer; the compressed cache's rounds, packed across rows). A row
        not adopted yet is priced at the length the last adoption kept, and adopted once its plan drafts
        from the cache: a row that prompt lookup serves never pays for its window and compression."""
        k = self.num_speculative_tokens
        lookups = [find_match(history, k, self.lookup) if self.lookup is not None else LookupMatch([], 0)
                   for history in histories]
        contexts = [len(history) - 1 for history in histories]
        cached = [sequence.cache.stored_tokens() if sequence.cache is not None else min(self.kept_tokens or context,
                                                                                       context)
                  for sequence, context in zip(sequences, contexts, strict=True)]
        adopt_s = [0.0 if sequence.cache is not None else self.stats.adopt_s_per_token() * context
                   for sequence, context in zip(sequences, contexts, strict=True)]
        if self.draft_length == "auto":
            step = StepRows([sequence.sources for sequence in sequences], lookups, cached, contexts, adopt_s)
            plans = plan_rows(step, k, self.costs, self.lookup_acceptance)
        else:
            plans = fixed_plans([match.token_ids for match in lookups], k)
        for index, plan in enumerate(plans):
            if plan.source == CACHE and sequences[index].cache is None:
                assert handover is not None, "only a handed-over row waits for its adoption"
                sequences[index] = self._adopt(sequences[index], histories[index], handover, batch_rows[index])
        drafts: list[list[int]] = [[] for _ in sequences]
        for index, (plan, match) in enumerate(zip(plans, lookups, strict=True)):
            if plan.source == LOOKUP:
                drafts[index] = match.token_ids[: plan.num_draft_tokens]
                self.stats.num_lookup_rounds += 1
                self.stats.num_lookup_draft_tokens += len(drafts[index])
        cache_rows = [index for index, plan in enumerate(plans) if plan.source == CACHE]
        self.stats.num_cache_rounds += len(cache_rows)
        rows = [DraftRow(histories[i], cache) for i in cache_rows if (cache := sequences[i].cache) is not None]
        from_cache = self._draft_from_caches([sequences[i] for i in cache_rows], rows,
                                             [plans[i].num_draft_tokens for i in cache_rows])
        for index, drafted in zip(cache_rows, from_cache, strict=True):
            drafts[index] = drafted
        for sequence, plan, drafted, match in zip(sequences, plans, drafts, lookups, strict=True):
            record = self.lookup_acceptance.of(match.ngram) if plan.source == LOOKUP else sequence.sources.cache
            sequence.sources.pending = (record, len(drafted)) if plan.source is not None and drafted else None
        self.stats.num_plain_rows += sum(plan.source is None for plan in plans)
        return drafts

    def _draft_from_caches(self, sequences: list[DraftSequence], rows: list[DraftRow],
                           lengths: list[int]) -> list[list[int]]:
        """The history tokens each cache lacks (what vLLM accepted) reach it in one packed forward, whose
        logits start kvlab's compressed-cache drafter's rounds (`lengths[row]` greedy drafts each, packed
        across rows); the drafts' KV is dropped again after."""
        if not sequences:
            return []
        assert self.model is not None
        model = draft_model(self.model.model, self.draft_weights)
        clock = Stopwatch(self.model.device)
        captured: list[LayerKV] = [[] for _ in sequences]
        catch_up = [Feed(row.draft, row.history[row.draft.seq_lengths[0]:].tolist(), drafting=True,
                         captured=layer_kv) for row, layer_kv in zip(rows, captured, strict=True)]
        batch = pack(model, catch_up)
        logits, seconds = run_batch(batch, model.device)
        self._observe(batch, seconds)
        by_feed = {id(feed): row_logits for feed, row_logits in zip(batch.feeds, logits, strict=True)}
        for sequence, row, feed, layer_kv in zip(sequences, rows, catch_up, captured, strict=True):
            keys, values = layer_kv[0]
            sequence.last_kv = (keys[:, :, -1:].clone(), values[:, :, -1:].clone())
            row.draft_logits = by_feed[id(feed)]
        self.stats.num_catch_up_tokens += sum(len(feed.token_ids) for feed in catch_up)
        drafter = CompressedCacheDrafter(self.draft_weights)
        # Drafted tokens are provisional: a compressed layer never compresses what is rolled back.
        for row in rows:
            row.draft.set_provisional(True)
        try:
            proposals = run_to_end(model, [drafter.draft(row, row, Offer(drafter, length), length)
                                           for row, length in zip(rows, lengths, strict=True)], self._observe)
            for row, proposal in zip(rows, proposals, strict=True):
                row.draft.drop_last(proposal.num_fed)
        finally:
            for row in rows:
                row.draft.set_provisional(False)
        for sequence, row in zip(sequences, rows, strict=True):
            sequence.token_ids = row.history.copy()
        self.stats.draft_s += clock.elapsed()
        self.stats.num_draft_tokens += sum(len(proposal.token_ids) for proposal in proposals)
        return [proposal.token_ids for proposal in proposals]

    def _observe(self, batch: PackedBatch, seconds: float) -> None:
        """A packed draft forward: kvlab's cost model of them sees it."""
        self.costs.observe_draft(batch.shapes, seconds)
        self.stats.num_draft_forwards += 1
