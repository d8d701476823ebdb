"""Remote-prefix lossless decoding: draft from a low-bit prefix while the exact prefix is still arriving.

A prompt whose prefix sits in a store at two resolutions starts like this: a small low-bit copy of
part of the prefix (the first chunk and the last few, `LosslessConfig.prefix_draft_chunks`) is
fetched first and becomes the draft cache's prefix (the drafter compresses it like any prompt); while
the bit-exact copy transfers on a background thread, the sequence already drafts in the run like any
other. When the exact prefix has landed, its first verify forward covers the rest of the prompt and
the drafts on the full cache. The verifier only ever reads exact KV, so output is identical to
recomputing the whole prompt; the drafting hides behind the transfer.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from kvlab.cache import ForwardStep, KVCache, run_step
from kvlab.cache.tiers import move_to_tier
from kvlab.generation.prefill import prefill_pieces
from kvlab.lossless.run import LosslessRun, new_sequence
from kvlab.lossless.sequence import Sequence
from kvlab.store.prefix import PrefixSource
from kvlab.store.resolution import exact_resolutions
from kvlab.timing import Stopwatch


def admit_remote(run: LosslessRun, request: int, prompt: list[int], prefix: PrefixSource) -> bool:
    """Start `prompt` from its low-bit prefix (see the module docstring) and add it to `run`.

    Returns False when no low-bit chunk could be fetched: the caller then prefills as usual.
    """
    settings = run.lossless
    assert settings.prefix_draft is not None
    # The first chunk and the last (window - 1) of the stored run, counted from its end by the fetch.
    window = settings.prefix_draft_chunks
    chunks = None if window is None else [0, *range(1 - window, 0)]
    low = prefix.fetch(prompt, (settings.prefix_draft,), chunks)
    if low.num_tokens == 0:
        return False
    transfer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-exact-prefix")
    exact_prefix = transfer.submit(prefix.fetch, prompt, exact_resolutions())
    transfer.shutdown(wait=False)

    loaded = run.loaded
    capacity = run.capacity(prompt, request)
    draft = KVCache.allocate(loaded.architecture, 1, capacity, loaded.dtype, loaded.device, run.settings[request].drafter)
    low.restore_into(draft, loaded.device)
    rest = torch.tensor([prompt[low.end :]], device=loaded.device)
    # The draft cache may skip chunks (stored compacted): the rest of the prompt is masked causally by
    # its index among the stored keys, while rotary phases use the true positions.
    stored_before = torch.arange(low.num_tokens, low.num_tokens + rest.shape[1], device=loaded.device)[None]
    step = ForwardStep(draft, draft.next_positions(rest.shape[1], loaded.device), compress=True, mask_positions=stored_before)
    logits = run_step(run.drafter, step, rest, logits_to_keep=1)[:, -1]
    run.stats.prefix_fetches.append(low.stats)

    sequence = new_sequence(run, request, prompt, None, draft, pending=[], draft_missing=0)
    sequence.draft_logits = logits[0]
    sequence.exact_prefix = exact_prefix
    sequence.land_prefix = lambda: _land_exact_prefix(run, sequence, prefix, capacity)
    run.admit(sequence, [])
    return True


def _land_exact_prefix(run: LosslessRun, sequence: Sequence, prefix: PrefixSource, capacity: int) -> None:
    """Build the sequence's full cache from the landed exact prefix; the rest of the prompt becomes
    pending, to be verified together with the drafts."""
    assert sequence.exact_prefix is not None
    loaded, prompt = run.loaded, sequence.prompt
    wait = Stopwatch()
    exact = sequence.exact_prefix.result()  # re-raises what failed on the transfer thread
    run.lossless_stats.kv_load_s += wait.elapsed()
    sequence.exact_prefix = None
    full = KVCache.allocate(loaded.architecture, 1, capacity, loaded.dtype, loaded.device)
    exact.restore_into(full, loaded.device)
    # Complete chunks of the rest are computed on their own, as a prefill would (their KV is saved and
    # must have the bits recomputing them gives); the last piece goes with the drafts.
    pieces = prefill_pieces(exact.end, len(prompt), prefix.chunk_tokens)
    for begin, end in pieces[:-1]:
        chunk_step = ForwardStep(full, full.next_positions(end - begin, loaded.device), captured=[])
        clock = Stopwatch(loaded.device)
        run_step(loaded.model, chunk_step, torch.tensor([prompt[begin:end]], device=loaded.device), logits_to_keep=1)
        prefix.observe_prefill(end - begin, clock.elapsed())
        assert chunk_step.captured is not None
        prefix.save(prompt, begin, chunk_step.captured)
    sequence.pending = prompt[pieces[-1][0] :]
    sequence.full = move_to_tier(full, run.loader, capacity)
    run.stats.prefix_reused_tokens += exact.end
    run.stats.prefix_fetches.append(exact.stats)
