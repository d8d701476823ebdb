"""`KVLabDraftProposer`: VeriCache self-drafting from a compressed KV cache, as a vLLM proposer.

vLLM (`speculative_config={"method": "custom_class", "model": "kvlab.integrations.vllm.KVLabDraftProposer"}`)
builds it with the engine's config, hands it the target model in `load_model`, and calls `propose`
every step with each batch row's token history. The proposer drafts `num_speculative_tokens` greedy
tokens per row from the same checkpoint running on a kvlab compressed cache; vLLM verifies them
with its full KV, so output is identical to plain decoding whatever the drafts are.

What the token-only interface costs (measured in benchmarks/vllm_integration.py, docs/vllm.md):
- vLLM's model module cannot attend over a kvlab cache, so the checkpoint is loaded a second time
  into transformers modules with kvlab attention (the drafter shares no weights or KV with vLLM);
- the proposer sees no request ids and no KV: it keeps one draft cache per sequence, found again by
  token prefix (rows are reordered between steps), and prefills each new sequence's prompt itself
  (a second prefill, then compressed);
- every step it catches up on the tokens vLLM accepted with one forward over them.

The drafter is any kvlab compressor, chosen by `KVLAB_VLLM_DRAFTER` (JSON `{"name": ..., **params}`,
default `{"name": "snapkv"}`): vLLM passes a custom proposer nothing but its config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
import torch

from kvlab.cache import KVCache, forward
from kvlab.compress import Compressor, compressors
from kvlab.errors import ConfigError
from kvlab.integrations.vllm.model import served_model, transformers_model
from kvlab.models import LoadedModel
from kvlab.timing import Stopwatch

DRAFTER_ENV = "KVLAB_VLLM_DRAFTER"
DEFAULT_DRAFTER: dict[str, Any] = {"name": "snapkv"}
# Sequences kept without being seen in a step: a preempted request that comes back finds its cache.
_MAX_IDLE_SEQUENCES = 8
# Room beyond the history allocated at once, so a sequence's cache rarely grows.
_CAPACITY_MARGIN = 256


@dataclasses.dataclass(slots=True)
class ProposerStats:
    """Where the proposer's time goes, summed over calls (seconds) and what it did (counts)."""

    num_calls: int = 0
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    num_catch_up_tokens: int = 0
    num_draft_tokens: int = 0
    prefill_s: float = 0.0
    catch_up_s: float = 0.0
    draft_s: float = 0.0
    total_s: float = 0.0


@dataclasses.dataclass(slots=True)
class DraftSequence:
    """A sequence's compressed draft cache and the token ids it has consumed (`[n]` int64)."""

    cache: KVCache
    token_ids: np.ndarray


def drafter_from_environment() -> Compressor:
    """The compressor `KVLAB_VLLM_DRAFTER` names (JSON), or SnapKV with its defaults."""
    text = os.environ.get(DRAFTER_ENV)
    try:
        spec = json.loads(text) if text else dict(DEFAULT_DRAFTER)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{DRAFTER_ENV} must be JSON like {{\"name\": \"snapkv\"}}, got {text!r}: {error}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{DRAFTER_ENV} must be a JSON object with a 'name', got {text!r}")
    return compressors.from_dict(spec)


class KVLabDraftProposer:
    """A vLLM `custom_class` proposer drafting with a kvlab compressed cache of the target checkpoint.

    Args:
        vllm_config: The engine's config (vLLM passes nothing else).
        drafter: The compressor whose cache drafts (default: from `KVLAB_VLLM_DRAFTER`).
    """

    def __init__(self, vllm_config: Any, drafter: Compressor | None = None) -> None:
        self.num_speculative_tokens = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.directory, self.dtype = served_model(vllm_config)
        self.drafter = drafter or drafter_from_environment()
        self.model: LoadedModel | None = None
        self.sequences: list[DraftSequence] = []
        self.stats = ProposerStats()

    def load_model(self, target_model: Any = None) -> None:
        """Load the served checkpoint for kvlab's attention (vLLM's module cannot use a kvlab cache)."""
        self.model = transformers_model(self.directory, self.dtype)
        target_vocab = getattr(getattr(target_model, "config", None), "vocab_size", None)
        if target_vocab is not None and target_vocab != self.model.model.config.vocab_size:
            raise ConfigError(f"KVLabDraftProposer: the drafter's vocabulary ({self.model.model.config.vocab_size}) "
                              f"differs from the target's ({target_vocab})")

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
            slot_mappings: vLLM's KV slots (unused: the draft cache is kvlab's own).
        """
        clock = Stopwatch(self.model.device if self.model is not None else "cpu")
        seen: list[DraftSequence] = []
        drafts: list[list[int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[row])
            if not sampled or num_tokens + self.num_speculative_tokens >= self.max_model_len:
                drafts.append([])
                continue
            history = np.asarray(token_ids_cpu[row, :num_tokens], dtype=np.int64)
            sequence = self._sequence_for(history)
            drafts.append(self._draft(sequence, history))
            seen.append(sequence)
        idle = [sequence for sequence in self.sequences if all(sequence is not s for s in seen)]
        self.sequences = seen + idle[:_MAX_IDLE_SEQUENCES]
        self.stats.num_calls += 1
        self.stats.total_s += clock.elapsed()
        return drafts

    def _sequence_for(self, history: np.ndarray) -> DraftSequence:
        """The kept sequence whose tokens are the longest prefix of `history`, or a newly prefilled one."""
        best: DraftSequence | None = None
        for sequence in self.sequences:
            length = len(sequence.token_ids)
            if length < len(history) and (best is None or length > len(best.token_ids)) and \
                    np.array_equal(history[:length], sequence.token_ids):
                best = sequence
        if best is not None:
            return best
        assert self.model is not None, "vLLM calls load_model before propose"
        model = self.model
        prompt = torch.from_numpy(history[None, :-1]).to(model.device)
        clock = Stopwatch(model.device)
        # All but the last token: `_draft` feeds what the cache has not consumed, as for a kept sequence.
        try:
            cache = self._prefill(prompt, self.drafter)
        except ConfigError:
            # The drafter refuses this prompt (shorter than its budget): a full cache drafts it instead.
            cache = self._prefill(prompt, None)
        self.stats.prefill_s += clock.elapsed()
        self.stats.num_prefills += 1
        self.stats.num_prefill_tokens += len(history) - 1
        return DraftSequence(cache, history[:-1].copy())

    def _prefill(self, prompt: torch.Tensor, compressor: Compressor | None) -> KVCache:
        """A draft cache holding `prompt` [1, n] int64, compressed by `compressor` (None: every token)."""
        assert self.model is not None
        model = self.model
        cache = KVCache.allocate(model.architecture, 1, prompt.shape[1] + _CAPACITY_MARGIN, model.dtype, model.device,
                                 compressor)
        with torch.inference_mode():
            forward(model.model, cache, prompt, logits_to_keep=1, compress=compressor is not None)
        return cache

    def _draft(self, sequence: DraftSequence, history: np.ndarray) -> list[int]:
        """Catch up on `history`'s new tokens with one forward, draft greedily, then drop the drafts' KV."""
        assert self.model is not None
        model, device = self.model.model, self.model.device
        new_tokens = torch.from_numpy(history[None, len(sequence.token_ids):]).to(device)
        with torch.inference_mode():
            clock = Stopwatch(device)
            logits = forward(model, sequence.cache, new_tokens, logits_to_keep=1)
            drafted = [int(logits[0, -1].argmax())]
            catch_up_s = clock.elapsed()
            clock.restart()
            # Drafted tokens are provisional: a compressed layer never compresses what is rolled back.
            with sequence.cache.provisional():
                for _ in range(self.num_speculative_tokens - 1):
                    step = torch.tensor([[drafted[-1]]], device=device)
                    drafted.append(int(forward(model, sequence.cache, step, logits_to_keep=1)[0, -1].argmax()))
                sequence.cache.drop_last(self.num_speculative_tokens - 1)
        draft_s = clock.elapsed()
        sequence.token_ids = history.copy()
        self.stats.catch_up_s += catch_up_s
        self.stats.draft_s += draft_s
        self.stats.num_catch_up_tokens += new_tokens.shape[1]
        self.stats.num_draft_tokens += len(drafted)
        return drafted
