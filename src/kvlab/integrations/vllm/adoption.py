"""Draft caches of `KVLabDraftProposer`: built from vLLM's handed-over pages, extended from them, or
prefilled by the drafter itself; and where the proposer's time goes.

A hand-over is trusted only as far as it is checked: the last `window` prompt tokens are computed
again by the drafter (the compressor's observation window needs their queries anyway) and their keys
and values must match the pages' within `handover_tolerance`. Pages that hold another prompt's KV,
or none, fail the check and the request is prefilled instead. Drafts never decide output (vLLM
verifies them), so a wrong hand-over that passed would cost speed only.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from kvlab.cache import ForwardStep, KVCache, run_step
from kvlab.compress import Compressor
from kvlab.errors import ConfigError
from kvlab.generation.config import GenerationConfig
from kvlab.integrations.vllm.handover import LayerKV, StepHandover
from kvlab.integrations.vllm.sources import RowRecord
from kvlab.models import LoadedModel
from kvlab.models.draft_weights import DraftWeights
from kvlab.timing import Stopwatch

logger = logging.getLogger("kvlab.integrations.vllm.proposer")

# Room beyond the history allocated at once, so a sequence's cache rarely grows.
CAPACITY_MARGIN = 256
# Prompt tokens the drafter computes again when it adopts handed-over KV (at least; a compressor's own
# observation window when larger).
MIN_WINDOW = 32
# How far the window's keys and values, computed by kvlab's modules, may be from vLLM's, relative to the
# largest magnitude in each layer: vLLM's kernels sum in other orders. Measured in float32 with SmolLM2
# (tests/integration/test_vllm_proposer.py): at most 2.6e-6. Half-precision types, not measured, get 8
# steps of their precision.
FLOAT32_TOLERANCE = 1e-4
# The same for a token whose KV cheaper draft weights computed (int8, int4 or bf16 linear layers): only a
# check that the pages hold that token at that position (another token or position differs by ~1).
DRAFT_WEIGHTS_TOLERANCE = 0.1
# Seconds per prompt token an adoption is taken to cost before the first is timed (measured alone on 2 cores
# with SmolLM2 in float32: 0.25 s for a 4K prompt, 0.49 s for 6.4K; the window's attention and SnapKV's scores
# over the whole prompt dominate).
ADOPT_S_PER_TOKEN = 7e-5
# vLLM verifies greedy drafts: the drafter draws the argmax (the length limit is vLLM's, not this one's).
GREEDY = GenerationConfig(max_new_tokens=1 << 30, temperature=0.0)
# A fallback of one kind is logged the first time and then every this many times.
_LOG_EVERY = 100


class HandoverMismatch(Exception):
    """The pages do not hold the KV the drafter computes for the same tokens."""


@dataclasses.dataclass(slots=True, eq=False)
class DraftSequence:
    """A sequence's compressed draft cache and the token ids it has consumed (`[n]` int64).

    Attributes:
        cache: None while a handed-over request is not adopted (no plan has drafted from its cache yet).
        last_kv: ([1, H_kv, 1, D] keys, values) of the first layer for the last consumed token, as the
            drafter computed it; vLLM's pages hold the same token's KV after the next step, which checks
            that they are this sequence's (token and position). Deeper layers' KV of that token differs:
            the drafter attended over its compressed cache.
        req_id: vLLM's request, where the hand-over named it.
    """

    cache: KVCache | None
    token_ids: np.ndarray
    last_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    sources: RowRecord = dataclasses.field(default_factory=RowRecord)
    req_id: str | None = None


@dataclasses.dataclass(slots=True)
class ProposerStats:
    """Where the proposer's time goes, summed over calls (seconds), and what it did (counts).

    `handover_s` reads pages; `adopt_s` computes the window, compresses and checks a handed-over
    prompt; `prefill_s` prefills prompts the hand-over did not bring; `draft_s` runs the packed draft
    forwards (catch-up tokens included: `num_catch_up_tokens` counts every token fed before the
    first draft, one per row with the hand-over). The rest of `total_s` is bookkeeping.
    `num_adopted_tokens` counts the adopted prompts' tokens (what `adopt_s` was spent on).
    `num_draft_tokens` counts the compressed cache's drafts, `num_lookup_draft_tokens` prompt lookup's;
    `num_lookup_rounds` and `num_cache_rounds` count the row steps each source drafted for, and
    `num_plain_rows` those that proposed nothing (no round was expected to beat their plain step).
    """

    num_calls: int = 0
    num_adopted: int = 0
    num_adopted_tokens: int = 0
    num_handover_tokens: int = 0
    num_window_tokens: int = 0
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    num_catch_up_tokens: int = 0
    num_draft_tokens: int = 0
    num_draft_forwards: int = 0
    num_lookup_rounds: int = 0
    num_lookup_draft_tokens: int = 0
    num_cache_rounds: int = 0
    num_plain_rows: int = 0
    handover_s: float = 0.0
    adopt_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    total_s: float = 0.0
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)

    def adopt_s_per_token(self) -> float:
        """Seconds per prompt token the adoptions so far took (ADOPT_S_PER_TOKEN before any)."""
        return self.adopt_s / self.num_adopted_tokens if self.num_adopted_tokens else ADOPT_S_PER_TOKEN

    def count_fallback(self, kind: str, detail: str) -> None:
        """Count a hand-over the proposer did not use, logging the first of each kind and every 100th."""
        count = self.fallbacks[kind] = self.fallbacks.get(kind, 0) + 1
        if count == 1 or count % _LOG_EVERY == 0:
            logger.warning("KVLabDraftProposer falls back to its own prefill (%s, %d so far): %s", kind, count, detail)


def synthetic_caches(model: LoadedModel, num_tokens: int, count: int) -> list[KVCache]:
    """`count` draft caches each holding `num_tokens` tokens of zero keys and values: what a draft forward reads
    over a compressed cache of that many kept tokens, for timing one before any prompt is adopted."""
    arch = model.architecture
    caches = []
    for _ in range(count):
        cache = KVCache.allocate(arch, 1, num_tokens + CAPACITY_MARGIN, model.dtype, model.device)
        zeros = torch.zeros(1, arch.num_kv_heads, num_tokens, arch.head_dim, dtype=model.dtype, device=model.device)
        cache.append([(zeros, zeros)] * arch.num_layers, [num_tokens])
        caches.append(cache)
    return caches


def observation_window(compressor: Compressor) -> int:
    """Prompt tokens recomputed on adoption: the compressor's observation window, at least MIN_WINDOW."""
    return max(MIN_WINDOW, int(getattr(compressor, "window_size", 0) or 0))


def handover_tolerance(dtype: torch.dtype) -> float:
    """How far (relative to a layer's largest magnitude) handed-over KV may be from the drafter's own."""
    return max(FLOAT32_TOLERANCE, 8 * torch.finfo(dtype).eps)


def kv_mismatch(computed: LayerKV, handed: LayerKV, tolerance: float | None = None) -> str | None:
    """Why the drafter's keys and values of some tokens are not the pages' (None: within `tolerance`,
    by default `handover_tolerance` of their dtype)."""
    if tolerance is None:
        tolerance = handover_tolerance(computed[0][0].dtype) if computed else FLOAT32_TOLERANCE
    for layer, (ours, theirs) in enumerate(zip(computed, handed, strict=True)):
        for name, a, b in (("keys", ours[0], theirs[0]), ("values", ours[1], theirs[1])):
            if a.shape != b.shape:
                return f"layer {layer} {name}: shape {tuple(b.shape)}, expected {tuple(a.shape)}"
            scale = float(a.abs().max()) or 1.0
            error = float((a.float() - b.float()).abs().max()) / scale
            if not error <= tolerance:
                return f"layer {layer} {name} differ by {error:.2e} of their largest magnitude"
    return None


@dataclasses.dataclass(slots=True)
class SequenceBuilder:
    """Makes and extends draft caches for one proposer (its model, drafter and stats)."""

    model: LoadedModel
    drafter: Compressor
    stats: ProposerStats
    draft_weights: DraftWeights = "same"

    def adopt(self, history: np.ndarray, handover: StepHandover, row: int) -> DraftSequence | None:
        """A draft cache of `history[:-1]` from row `row`'s pages, or None where the prompt is no longer
        than the window (a prefill then costs as little) or the drafter scores with every prompt query
        (it needs the prompt computed whole). Raises HandoverMismatch where the window's KV is not the
        pages'."""
        prompt_len = len(history) - 1
        window = observation_window(self.drafter)
        if prompt_len <= window or self.drafter.observes_every_query:
            return None
        head = prompt_len - window
        clock = Stopwatch(self.model.device)
        head_kv = handover.gather(row, 0, head)
        window_kv = handover.gather(row, head, prompt_len)
        self.stats.handover_s += clock.elapsed()
        clock.restart()
        cache, computed = self._build(history[head:prompt_len], head_kv)
        problem = kv_mismatch(computed, window_kv)
        self.stats.adopt_s += clock.elapsed()
        if problem is not None:
            raise HandoverMismatch(f"the pages do not hold this prompt's KV: {problem}")
        self.stats.num_adopted += 1
        self.stats.num_handover_tokens += head
        self.stats.num_window_tokens += window
        self.stats.num_adopted_tokens += prompt_len
        return DraftSequence(cache, history[:-1].copy())

    def extend(self, sequence: DraftSequence, history: np.ndarray, handover: StepHandover, row: int) -> bool:
        """Append the KV of `history[:-1]`'s tokens the cache lacks from the pages (False: the sequence
        is not a prefix of `history`, the cache cannot serve it). Raises HandoverMismatch where the
        pages' KV of the sequence's last token is not what the drafter computed for it."""
        assert sequence.cache is not None, "only an adopted sequence is extended"
        have, need = sequence.cache.seq_lengths[0], len(history) - 1
        if have > need or len(sequence.token_ids) != have or not np.array_equal(history[:have], sequence.token_ids):
            return False
        checked = 1 if sequence.last_kv is not None else 0
        if have < need or checked:
            clock = Stopwatch(self.model.device)
            layer_kv = handover.gather(row, have - checked, need)
            self.stats.handover_s += clock.elapsed()
            if sequence.last_kv is not None:
                first_keys, first_values = layer_kv[0]
                tolerance = None if self.draft_weights == "same" else DRAFT_WEIGHTS_TOLERANCE
                problem = kv_mismatch([sequence.last_kv], [(first_keys[:, :, :1], first_values[:, :, :1])], tolerance)
                if problem is not None:
                    raise HandoverMismatch(f"the pages do not hold this sequence's last token: {problem}")
            if have < need:
                sequence.cache.append([(k[:, :, checked:], v[:, :, checked:]) for k, v in layer_kv], [need - have])
                self.stats.num_handover_tokens += need - have
        sequence.token_ids, sequence.last_kv = history[:need].copy(), None
        return True

    def prefill(self, history: np.ndarray) -> DraftSequence:
        """A draft cache of `history[:-1]` prefilled by the drafter itself."""
        clock = Stopwatch(self.model.device)
        cache, _ = self._build(history[:-1], None)
        self.stats.prefill_s += clock.elapsed()
        self.stats.num_prefills += 1
        self.stats.num_prefill_tokens += len(history) - 1
        return DraftSequence(cache, history[:-1].copy())

    def _build(self, token_ids: np.ndarray, head_kv: LayerKV | None) -> tuple[KVCache, LayerKV]:
        """A draft cache holding `head_kv`'s tokens then `token_ids` (computed, compressed with the rest),
        and the computed tokens' keys and values per layer."""
        model = self.model
        head = 0 if head_kv is None else head_kv[0][0].shape[2]
        tokens = torch.from_numpy(np.ascontiguousarray(token_ids)[None]).to(model.device)
        for compressor in (self.drafter, None):
            cache = KVCache.allocate(model.architecture, 1, head + tokens.shape[1] + CAPACITY_MARGIN, model.dtype,
                                     model.device, compressor)
            if head_kv is not None:
                cache.append([(k.to(model.device, model.dtype), v.to(model.device, model.dtype)) for k, v in head_kv],
                             [head])
            captured: LayerKV = []
            step = ForwardStep(cache, cache.next_positions(tokens.shape[1], model.device), compressor is not None,
                               captured)
            try:
                run_step(model.model, step, tokens, logits_to_keep=1)
            except ConfigError:
                # The drafter refuses this prompt (shorter than its budget): a full cache drafts it instead.
                if compressor is None:
                    raise
                continue
            return cache, captured
        raise AssertionError("unreachable: a full cache refuses no prompt")


@dataclasses.dataclass(slots=True)
class DraftRow:
    """A vLLM row as kvlab's drafters see a lossless sequence (`RoundHost` and `RoundState`): its history,
    its draft cache, and the logits that predict its first draft once the cache holds the history.

    Attributes:
        history: [n] int64 token ids of the row (the tokens vLLM accepted included).
        draft: The row's compressed draft cache.
        draft_logits: [1, V] logits predicting the first draft (set after the catch-up forward).
    """

    history: np.ndarray
    draft: KVCache
    draft_logits: torch.Tensor | None = None
    pending: list[int] = dataclasses.field(default_factory=list)  # nothing past the history: vLLM verifies
    draft_missing: int = 0
    full: None = None  # vLLM holds the full KV
    in_transit: bool = False
    config: GenerationConfig = GREEDY
    generator: torch.Generator | None = None

    def context_ids(self) -> list[int]:
        return [int(token) for token in self.history]

    def remaining(self) -> int:
        return GREEDY.max_new_tokens  # vLLM stops the request; the proposer only drafts

    def emit(self, token_ids: list[int]) -> bool:
        raise NotImplementedError("vLLM emits a row's tokens; kvlab's drafters only propose")
