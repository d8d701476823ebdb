"""Remote-prefix lossless start: draft from a low-bit prefix while the exact prefix is still arriving.

A prompt whose prefix sits in a store at two resolutions starts like this: a small low-bit copy of
part of the prefix (the first chunk and the last few, `LosslessConfig.prefix_draft_chunks`) is
fetched first and becomes the draft cache's prefix (the drafter compresses it like any prompt); while
the bit-exact copy transfers on a background thread (`ExactPrefixInTransit`), the sequence already
drafts like any other. When the exact prefix has landed, its first verify forward covers the rest of
the prompt and the drafts on the full cache. The verifier only ever reads exact KV, so output is
identical to recomputing the whole prompt; the drafting hides behind the transfer.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvlab.cache import ForwardStep, KVCache, run_step
from kvlab.cache.tiers import TierLoader, move_to_tier
from kvlab.generation.outputs import GenerationStats
from kvlab.generation.prefill import PrefillCaches, PrefixReuse, PromptPrefill
from kvlab.lossless.config import LosslessConfig
from kvlab.lossless.stats import LosslessStats
from kvlab.models import LoadedModel
from kvlab.store.prefix import FetchedPrefix, PrefixSource
from kvlab.store.resolution import exact_resolutions
from kvlab.timing import Stopwatch


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixTarget:
    """Where a remote-prefix start lands: the model, the store, the full KV's tier and the figures."""

    loaded: LoadedModel
    prefix: PrefixSource
    loader: TierLoader
    stats: GenerationStats
    totals: LosslessStats


@dataclasses.dataclass(slots=True)
class RemoteStart:
    """A sequence started from a low-bit prefix.

    Attributes:
        draft: [1 row] the draft cache: the low-bit prefix, then the rest of the prompt, compressed.
        draft_logits: [1, V] logits predicting the first draft token.
        exact: The bit-exact prefix, in transit; it becomes the full cache before the first verify.
    """

    draft: KVCache
    draft_logits: torch.Tensor
    exact: ExactPrefixInTransit


def start_remote(
    target: PrefixTarget, drafter: torch.nn.Module, prompt: list[int], settings: LosslessConfig, capacity: int
) -> RemoteStart | None:
    """Start `prompt` from its low-bit prefix (see the module docstring), drafting with `drafter`.

    Returns None when no low-bit chunk could be fetched, or when the drafter scores with every prompt
    query (a remote start computes only the prompt's last tokens): the caller then prefills as usual.
    """
    assert settings.prefix_draft is not None
    if settings.drafter.observes_every_query:
        return None
    # The first chunk and the last (window - 1) of the stored run, counted from its end by the fetch.
    window = settings.prefix_draft_chunks
    chunks = None if window is None else [0, *range(1 - window, 0)]
    low = target.prefix.fetch(prompt, (settings.prefix_draft,), chunks)
    if low.num_tokens == 0:
        return None
    transfer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-exact-prefix")
    exact = transfer.submit(target.prefix.fetch, prompt, exact_resolutions())
    transfer.shutdown(wait=False)

    loaded = target.loaded
    draft = KVCache.allocate(loaded.architecture, 1, capacity, loaded.dtype, loaded.device, settings.drafter)
    low.restore_into(draft, loaded.device)
    rest = torch.tensor([prompt[low.end :]], device=loaded.device)
    # The draft cache may skip chunks (stored compacted): the rest of the prompt is masked causally by
    # its index among the stored keys, while rotary phases use the true positions.
    stored_before = torch.arange(low.num_tokens, low.num_tokens + rest.shape[1], device=loaded.device)[None]
    positions = draft.next_positions(rest.shape[1], loaded.device)
    step = ForwardStep(draft, positions, compress=True, mask_positions=stored_before)
    logits = run_step(drafter, step, rest, logits_to_keep=1)[:, -1]  # type: ignore[arg-type]
    target.stats.prefix_fetches.append(low.stats)
    return RemoteStart(draft, logits, ExactPrefixInTransit(target, exact, prompt, capacity))


@dataclasses.dataclass(slots=True)
class ExactPrefixInTransit:
    """The bit-exact prefix of a remote-prefix start, on its way (a future of the fetch)."""

    target: PrefixTarget
    fetch: Future[FetchedPrefix]
    prompt: list[int]
    capacity: int

    def landed(self) -> bool:
        return self.fetch.done()

    def land(self) -> tuple[KVCache, list[int]]:
        """The full cache built from the landed exact prefix (waiting for it if need be), and the rest
        of the prompt, pending: it is verified together with the drafts."""
        wait = Stopwatch()
        exact = self.fetch.result()  # re-raises what failed on the transfer thread
        self.target.totals.kv_load_s += wait.elapsed()
        # The same prefill as any prompt's: the exact prefix restored, then complete chunks of the rest
        # computed on their own and saved (they must have the bits recomputing them gives); the last
        # piece goes with the drafts.
        reuse = PrefixReuse(self.target.prefix, fetched=exact, stats=self.target.stats)
        job = PromptPrefill(self.target.loaded, self.prompt, PrefillCaches(self.capacity), reuse)
        while len(job.pieces) > 1:
            job.step()
        return move_to_tier(job.cache, self.target.loader, self.capacity), self.prompt[job.pieces[0][0] :]
