"""Remote-prefix lossless decoding: draft from a low-bit prefix while the exact prefix is still arriving.

A prompt whose prefix sits in a store at two resolutions starts like this: a small low-bit copy of
part of the prefix (the first chunk and the last few, `SpecConfig.prefix_draft_chunks`) is fetched
first and becomes the draft cache's prefix (the drafter compresses it like any prompt); while the
bit-exact copy transfers in the background, the drafter already drafts the first tokens. When the
exact prefix has landed, one forward over the rest of the prompt and the drafts, on the full cache,
verifies them. The verifier only ever reads exact KV, so output is identical to recomputing the whole
prompt; the drafting hides behind the transfer.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

import torch

from kvlab.cache import ForwardStep, KVCache, forward, run_step
from kvlab.generation.config import GenerationConfig
from kvlab.generation.engine import GenerationStats, prefill_pieces
from kvlab.generation.sampling import draw_tokens
from kvlab.models import LoadedModel
from kvlab.models.draft_weights import draft_model
from kvlab.lossless.acceptance import accept_drafts
from kvlab.lossless.stats import SpecStats
from kvlab.store.prefix import FetchedPrefix, PrefixSource
from kvlab.store.resolution import exact_resolutions
from kvlab.timing import Stopwatch

if TYPE_CHECKING:  # kvlab.lossless.engine imports this module
    from kvlab.lossless.engine import SpecConfig


@dataclasses.dataclass(slots=True)
class RemoteStart:
    """A prompt after its first verified round: both caches hold everything before `next_token`."""

    full: KVCache
    draft: KVCache
    emitted: list[int]
    next_token: torch.Tensor  # [1] int64


def remote_prefix_start(
    loaded: LoadedModel,
    prompt: list[int],
    capacity: int,
    prefix: PrefixSource,
    spec: SpecConfig,
    config: GenerationConfig,
    generator: torch.Generator | None,
    stats: GenerationStats,
    spec_stats: SpecStats,
    max_drafts: int,
) -> RemoteStart | None:
    """Start one prompt from a low-bit prefix (see the module docstring).

    Drafts at most `max_drafts` tokens (at least one) while the exact prefix transfers: every draft
    lengthens the verify pass, and acceptance decays along a draft.

    Returns None when no low-bit chunk could be fetched: the caller then prefills normally.
    """
    assert spec.prefix_draft is not None
    # The first chunk and the last (window - 1) of the stored run, counted from its end by the fetch.
    window = spec.prefix_draft_chunks
    chunks = None if window is None else [0, *range(1 - window, 0)]
    low = prefix.fetch(prompt, (spec.prefix_draft,), chunks)
    if low.num_tokens == 0:
        return None
    arrived: dict[str, FetchedPrefix] = {}
    transfer = threading.Thread(
        target=lambda: arrived.update(exact=prefix.fetch(prompt, exact_resolutions())),
        name="kvlab-exact-prefix",
        daemon=True,
    )
    transfer.start()

    draft_clock = Stopwatch(loaded.device)
    architecture, dtype, device = loaded.architecture, loaded.dtype, loaded.device
    draft = KVCache.allocate(architecture, 1, capacity, dtype, device, spec.drafter)
    low.restore_into(draft, device)
    drafter = draft_model(loaded.model, spec.draft_weights)
    rest = torch.tensor([prompt[low.end :]], device=device)
    # The draft cache may skip chunks (stored compacted): the rest of the prompt is masked causally by
    # its index among the stored keys, while rotary phases use the true positions.
    stored_before = torch.arange(low.num_tokens, low.num_tokens + rest.shape[1], device=device)[None]
    step = ForwardStep(draft, draft.next_positions(rest.shape[1], device), compress=True, mask_positions=stored_before)
    logits = run_step(drafter, step, rest, logits_to_keep=1)[:, -1]
    drafts, probs = [], []
    with draft.provisional():
        # Draft until the exact prefix is in (at least one token, at most `max_drafts`).
        while True:
            token, distribution = draw_tokens(logits, config, generator)
            drafts.append(token)
            if distribution is not None:
                probs.append(distribution)
            if len(drafts) >= max_drafts or not transfer.is_alive():
                break
            logits = forward(drafter, draft, token[:, None], logits_to_keep=1)[:, -1]
        # Every draft but the last was fed back; their drafted KV makes way for the verifier's below.
        draft.drop_last(len(drafts) - 1)
    draft_s = draft_clock.elapsed()
    transfer.join()
    exact = arrived["exact"]
    spec_stats.kv_load_s += max(0.0, exact.stats.fetch_s - draft_s)

    verify_clock = Stopwatch(device)
    full = KVCache.allocate(architecture, 1, capacity, dtype, device)
    exact.restore_into(full, device)
    # Complete chunks of the rest are computed on their own, as a prefill would (their KV is saved and
    # must have the bits recomputing them gives); the last piece goes with the drafts.
    pieces = prefill_pieces(exact.end, len(prompt), prefix.chunk_tokens)
    for begin, end in pieces[:-1]:
        chunk_step = ForwardStep(full, full.next_positions(end - begin, device), captured=[])
        run_step(loaded.model, chunk_step, torch.tensor([prompt[begin:end]], device=device), logits_to_keep=1)
        assert chunk_step.captured is not None
        prefix.save(prompt, begin, chunk_step.captured)
    begin = pieces[-1][0]
    computed = len(prompt) - begin
    draft_ids = torch.stack(drafts, dim=1)  # [1, k]
    step = ForwardStep(full, full.next_positions(computed + len(drafts), device), captured=[])
    verify_ids = torch.cat([torch.tensor([prompt[begin:]], device=device), draft_ids], dim=1)
    # Logits from the last prompt token on: it predicts the first draft.
    target_logits = run_step(loaded.model, step, verify_ids, logits_to_keep=len(drafts) + 1)
    draft_probs = torch.stack(probs, dim=1) if probs else None
    num_accepted, next_token = accept_drafts(draft_ids, draft_probs, target_logits, config, generator)
    accepted = int(num_accepted[0])
    full.drop_last(len(drafts) - accepted)
    assert step.captured is not None
    draft.append([(k[:, :, computed:], v[:, :, computed:]) for k, v in step.captured], [accepted])
    prefix.observe_prefill(len(prompt) - exact.end + len(drafts), verify_clock.elapsed())

    spec_stats.draft_s += draft_s
    spec_stats.verify_s += verify_clock.elapsed()
    spec_stats.record_round(len(drafts), [accepted])
    stats.prefix_reused_tokens += exact.end
    stats.prefix_fetches.extend([low.stats, exact.stats])
    emitted = draft_ids[0, :accepted].tolist() + [int(next_token[0])]
    return RemoteStart(full, draft, emitted, next_token)
