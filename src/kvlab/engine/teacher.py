"""Teacher forcing: given tokens fed through the full cache and a compressed one, for their logits.

What a benchmark scores a compressor by (KL divergence, perplexity): no token is chosen here, the
continuation is given.

One prefill fills both caches from the same forward (`PairedPrefillStep`, as lossless decoding fills
its draft cache): the prompt's attention is exact in both, and the compressor compresses each layer
right after attending, as lossy decoding's prefill does, with the same keys and queries. The
continuation then goes through the full cache in one forward, and through the compressed cache in
the fewest forwards that change nothing it sees: the tokens are fed as lossy decoding feeds its own
(`run_packed`, one segment of the sequence), split where decoding would change how earlier tokens
are stored (a quantizer's flush of its oldest residual tokens), so every position attends over what
it would attend over if it had been decoded one token at a time.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlab.cache import KVCache, Segment, run_packed
from kvlab.compress import Compressor, EvictionCompressor, QuantizationCompressor
from kvlab.generation.prefill import PrefillCaches, PromptPrefill
from kvlab.models import LoadedModel


@dataclasses.dataclass(frozen=True, slots=True)
class TeacherForcing:
    """One sample's teacher-forced passes.

    Attributes:
        prompt: Prompt token ids.
        continuation: The tokens to score (the full-KV greedy output), at least one.
        compressor: The compressed cache's compressor; None scores the full cache against itself.
        chunk_tokens: Prefill in forwards cut at multiples of this (as the sample's generation did;
            None: one forward).
    """

    prompt: list[int]
    continuation: list[int]
    compressor: Compressor | None = None
    chunk_tokens: int | None = None


@torch.inference_mode()
def teacher_forced_logits(loaded: LoadedModel, forcing: TeacherForcing) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, V] float32 logits of the full and the compressed cache; row t predicts continuation token t.

    Row 0 comes from the prompt's last position, the same in both caches (the prompt's own attention
    is exact). Without a compressor both results are the same tensor.
    """
    prompt, continuation = forcing.prompt, forcing.continuation
    if not continuation:
        raise ValueError("nothing to teacher-force: the continuation is empty")
    caches = PrefillCaches(len(prompt) + len(continuation), drafter=forcing.compressor)
    job = PromptPrefill(loaded, prompt, caches, chunk_tokens=forcing.chunk_tokens)
    while not job.done:
        job.step()
    assert job.logits is not None
    first = job.logits.float()
    fed = continuation[:-1]  # the last token is only predicted
    full = torch.cat([first, *_feed(loaded, job.cache, fed, [(0, len(fed))])])
    if job.draft is None:
        return full, full
    pieces = continuation_pieces(forcing.compressor, max(job.draft.seq_lengths), len(fed))
    return full, torch.cat([first, *_feed(loaded, job.draft, fed, pieces)])


def continuation_pieces(compressor: Compressor | None, num_stored: int, num_tokens: int) -> list[tuple[int, int]]:
    """Ranges of the `num_tokens` fed tokens, each fed in one forward, after `num_stored` stored tokens.

    Eviction and merging caches change nothing once the prompt is compressed: one range. A quantizer
    quantizes its oldest residual tokens as appends make `num_to_quantize` grow, before the new token
    attends. Fed one at a time, token i sees the first `num_to_quantize(num_stored + i + 1)` stored
    tokens quantized; fed in a range ending at b, it sees those below `num_to_quantize(num_stored + b)`,
    of which only the ones up to itself are visible to it. A range is grown while that leaves every
    token in it seeing what it sees decoded one at a time. Any other kind of cache: one token per range.
    """
    if num_tokens == 0:
        return []
    if compressor is None or isinstance(compressor, EvictionCompressor):
        return [(0, num_tokens)]
    if not isinstance(compressor, QuantizationCompressor):
        return [(i, i + 1) for i in range(num_tokens)]
    quantized = compressor.num_to_quantize

    def sees_the_same(i: int, end: int) -> bool:
        visible = num_stored + i + 1  # stored tokens once token i is appended: itself and what precedes it
        return min(quantized(num_stored + end), visible) == quantized(visible)

    pieces, begin = [], 0
    while begin < num_tokens:
        end = begin + 1
        while end < num_tokens and all(sees_the_same(i, end + 1) for i in range(begin, end + 1)):
            end += 1
        pieces.append((begin, end))
        begin = end
    return pieces


def _feed(
    loaded: LoadedModel, cache: KVCache, token_ids: list[int], pieces: list[tuple[int, int]]
) -> list[torch.Tensor]:
    """Per piece, [end - begin, V] float32 logits of its tokens, fed after what `cache` holds."""
    outputs = []
    for begin, end in pieces:
        segment = Segment(cache, end - begin)
        outputs.append(run_packed(loaded.model, [segment], [token_ids[begin:end]], list(range(end - begin))).float())
    return outputs
