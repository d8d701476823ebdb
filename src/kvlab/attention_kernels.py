"""Float32 attention kernels behind `kvlab.attention.attend_newest`: one query's split-KV decode and a
verify's key pieces on the CPU, a few queries' scores written out as matrix products anywhere.

On the CPU the generic kernels leave the two cores idle or unbalanced. Up to `NEWEST_ATTENTION_MAX_ROWS`
query rows per KV head (a plain or draft step, a short verify) take the C++ split-KV kernel
(`NEWEST_ATTENTION`, `kernels/decode_attention.cpp`), which takes all such segments of a packed forward in
one call, their sequences, KV heads and chunks of keys spread over the threads; where it cannot be built,
one query over a long cache takes `split_kv_decode`, compiled by inductor. A few queries over a long cache
(a verify) are arithmetic, and the flash kernel parallelizes over batch x heads only: with SmolLM2's 3 KV
heads on 2 threads, one thread waits while the other takes the third head. `verify_in_pieces` makes the key
axis a batch axis (pieces are views, nothing is copied) so the work splits evenly, and merges the pieces by
their log-sum-exp. Every path here is tested against the masked reference
(`kvlab.attention.attend_newest_reference`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from kvlab import paths

logger = logging.getLogger(__name__)


# Keys per chunk of `split_kv_decode`, and the fewest keys for which the CPU takes it: measured on 2
# cores of an EPYC, 30 layers at 8064 keys, chunks of 16 read the KV at 25 GB/s against 13.5 for the
# folded SDPA call (the flash kernel parallelizes over the 3 KV heads only); below about 600 keys the
# compiled call's fixed cost wins.
SPLIT_KV_CHUNK = 16
SPLIT_KV_MIN_KEYS = 768


def split_kv_decode(folded: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of one token's GQA-folded queries over every stored key, split along the keys ("flash
    decoding"), in torch ops written for inductor's CPU code generation.

    The keys are viewed as chunks of `SPLIT_KV_CHUNK` (a tail of 2 to `SPLIT_KV_CHUNK + 1` keys apart,
    so that one compiled graph serves every length); each chunk's scores, maximum, exponentials, sum and
    weighted values are independent (the chunks spread over the threads, keys innermost so the
    reductions vectorize), and a log-sum-exp merge combines them. Keys and values are each read once.

    Args:
        folded: [1, H_kv, G, D] the query heads of each KV head's group, rotary applied.
        keys, values: [1, H_kv, T, D], T >= SPLIT_KV_CHUNK + 2 (one chunk and a tail of two).

    Returns:
        [1, H_kv, G, D] float32.
    """
    kv_heads, rows, dim = folded.shape[1], folded.shape[2], folded.shape[3]
    num_keys = keys.shape[2]
    queries = folded.reshape(kv_heads, rows, dim) * scaling
    num_chunks = (num_keys - 2) // SPLIT_KV_CHUNK
    split = num_chunks * SPLIT_KV_CHUNK
    chunk_keys = keys[0, :, :split].unflatten(1, (num_chunks, SPLIT_KV_CHUNK))  # [H_kv, n, L, D]
    chunk_values = values[0, :, :split].unflatten(1, (num_chunks, SPLIT_KV_CHUNK))
    scores = (chunk_keys[:, :, None] * queries[:, None, :, None]).sum(-1)  # [H_kv, n, G, L]
    top = scores.amax(-1)  # [H_kv, n, G]
    weights = (scores - top[..., None]).exp()
    mass = weights.sum(-1)
    outputs = (weights[..., None] * chunk_values[:, :, None]).sum(3)  # [H_kv, n, G, D]
    tail_keys, tail_values = keys[0, :, split:], values[0, :, split:]
    tail_scores = (tail_keys[:, None] * queries[:, :, None]).sum(-1)  # [H_kv, G, tail]
    tail_top = tail_scores.amax(-1)
    tail_weights = (tail_scores - tail_top[..., None]).exp()
    tail_mass = tail_weights.sum(-1)
    tail_output = (tail_weights[..., None] * tail_values[:, None]).sum(2)  # [H_kv, G, D]
    overall = torch.maximum(top.amax(1), tail_top)
    scale, tail_scale = (top - overall[:, None]).exp(), (tail_top - overall).exp()
    numerator = (outputs * scale[..., None]).sum(1) + tail_output * tail_scale[..., None]
    denominator = (mass * scale).sum(1) + tail_mass * tail_scale
    return (numerator / denominator[..., None]).reshape(1, kv_heads, rows, dim)


class CompiledSplitKV:
    """`split_kv_decode` compiled once per process (only the key count dynamic: no length recompiles), called
    under a lock (compiling is not thread-safe; engines may run on several threads). Where compiling fails
    (no C++ compiler, no inductor) it says so once and returns None from then on: the caller goes eager."""

    def __init__(self) -> None:
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._failed = False
        self._lock = threading.Lock()

    def attend(
        self, folded: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
    ) -> torch.Tensor | None:
        if self._failed:
            return None
        with self._lock:
            try:
                if self._compiled is None:
                    self._compiled = torch.compile(split_kv_decode, dynamic=False)
                torch._dynamo.mark_dynamic(keys, 2)
                torch._dynamo.mark_dynamic(values, 2)
                return self._compiled(folded, keys, values, scaling)
            except Exception as error:  # any compiler failure: the eager path is always there
                self._failed = True
                logger.warning("split-KV decode attention could not be compiled (%s); decoding takes SDPA", error)
                return None


SPLIT_KV = CompiledSplitKV()
"""The process's compiled `split_kv_decode` (one per process: compiling is per graph, not per caller)."""


def warm_up_split_kv(kv_heads: int, group: int, head_dim: int) -> bool:
    """Make one query's fast path ready now, so no timed step or first long request pays for it: the C++
    kernel built or loaded (about 30 s the first time on a machine, a fraction of a second after), else
    `split_kv_decode` compiled for a model's geometry (about 2 s with inductor's disk cache warm, 10 s
    cold); returns whether either is ready. The compiling call
    looks like a forward's (separate views of longer key and value buffers made outside inference mode,
    queries made inside it): a graph compiled for other strides, aliasing, dispatch keys or grad mode was
    compiled again inside the first long request."""
    if NEWEST_ATTENTION.ready():  # one query takes the C++ kernel: nothing to compile
        return True
    ready = True
    for capacity in (2 * SPLIT_KV_MIN_KEYS, 3 * SPLIT_KV_MIN_KEYS):
        keys, values = (torch.zeros(1, kv_heads, capacity, head_dim)[:, :, : SPLIT_KV_MIN_KEYS + 1] for _ in range(2))
        with torch.inference_mode():
            folded = torch.zeros(1, kv_heads, group, head_dim)
            ready = ready and SPLIT_KV.attend(folded, keys, values, head_dim**-0.5) is not None
    return ready


class NewestAttentionKernel:
    """The C++ split-KV kernel (`kernels/decode_attention.cpp` beside this file): attention of each sequence's
    newest queries over its float32 cache, every sequence, KV head and chunk of keys one work item of one
    parallel loop. Built at first use by torch's extension builder (g++ and ninja, for this CPU: the build
    directory is per CPU model and environment under the kvlab cache directory, about 30 s once; loading a
    built one takes a fraction of a second), under a lock; where building
    fails it says so once and returns None from then on: the caller takes the compiled `split_kv_decode`."""

    def __init__(self) -> None:
        self._module: ModuleType | None = None
        self._failed = False
        self._aside = False
        self._lock = threading.Lock()

    def ready(self) -> bool:
        """Whether the kernel is built (building it now if it was not tried yet) and not set aside."""
        if self._aside:
            return False
        if self._module is None and not self._failed:
            with self._lock:
                if self._module is None and not self._failed:
                    try:
                        self._module = _build_newest_attention()
                    except Exception as error:  # no compiler, no ninja, a failed build: the other paths remain
                        self._failed = True
                        logger.warning("the C++ attention kernel could not be built (%s); decoding takes the "
                                       "compiled split-KV path", error)
        return self._module is not None

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Within this block the kernel is not used and its callers take their fallbacks (for comparisons and
        for testing the fallbacks)."""
        self._aside = True
        try:
            yield
        finally:
            self._aside = False

    def attend(self, folded: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
               num_queries: list[int], scaling: float) -> list[torch.Tensor] | None:
        """[H_kv, G*q, D] per sequence for its folded queries [H_kv, G*q, D] (row = g * q + query) over keys
        and values [1, H_kv, T, D] (float32 on the CPU, last dimension contiguous, the queries' own keys
        last); None where the kernel is not built."""
        if not self.ready():
            return None
        assert self._module is not None
        return self._module.newest_attention(folded, keys, values, num_queries, scaling, NEWEST_ATTENTION_CHUNK)


# Keys per work item of the C++ kernel: at 8064 keys, 3 KV heads x 16 chunks = 48 items spread over the threads.
NEWEST_ATTENTION_CHUNK = 512
# The most query rows per KV head (G x q) the C++ kernel takes; more go to the matrix-product paths, whose
# GEMMs do a row's scores cheaper. Measured on 2 cores of an EPYC (SmolLM2, G = 3, 30 layers, interleaved):
# at 8064 keys 2 queries took 33.8 ms against 66.8, 5 49.1 against 57.6, 6 49.2 against 53.5, 7 59.2
# against 58.0, 9 73.6 against 65.9; at 4096 keys and below it was ahead up to 9 queries.
NEWEST_ATTENTION_MAX_ROWS = 18


def takes_newest_kernel(folded: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether queries folded as [.., H_kv, G*q, D] over `keys` take the C++ kernel: float32 on the CPU, at most
    `NEWEST_ATTENTION_MAX_ROWS` rows per KV head, and the kernel built."""
    return (keys.device.type == "cpu" and keys.dtype == torch.float32 and folded.shape[-2] <= NEWEST_ATTENTION_MAX_ROWS
            and NEWEST_ATTENTION.ready())


def newest_kernel_queries(num_kv_groups: int, device: torch.device, dtype: torch.dtype) -> int:
    """The most newest queries of one sequence the C++ kernel takes for a model whose KV heads each serve
    `num_kv_groups` query heads (its rows are groups x queries, at most `NEWEST_ATTENTION_MAX_ROWS`), its cache
    of `dtype` on `device`; 1 where the kernel does not run: not float32 on the CPU, or the kernel not built
    (building it now if it was not tried yet). What `kvlab.lossless.cost_model` prices apart."""
    if device.type != "cpu" or dtype != torch.float32 or not NEWEST_ATTENTION.ready():
        return 1
    return max(NEWEST_ATTENTION_MAX_ROWS // max(num_kv_groups, 1), 1)


def _build_newest_attention() -> ModuleType:
    from torch.utils import cpp_extension

    source = Path(__file__).with_name("kernels") / "decode_attention.cpp"
    build_dir = paths.cache_dir() / "torch_extensions" / f"decode_attention-{_build_fingerprint()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja may be installed beside this interpreter (a venv not on PATH): on PATH for the build only.
    path = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path or ""])
    try:
        return cpp_extension.load(
            name="kvlab_decode_attention", sources=[str(source)], build_directory=str(build_dir),
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    finally:
        if path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = path


def _build_fingerprint() -> str:
    """A short name for this CPU's model and flags (the kernel is built with -march=native), the environment,
    the interpreter and torch (the module is built against them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        cpu = platform.processor()
    # The environment too: torch's builder rebuilds when its include paths change, so two venvs sharing one
    # directory would rebuild each other's module in turn.
    built_for = f"{platform.machine()} {cpu} {sys.prefix} {sys.implementation.cache_tag} {torch.__version__}"
    return hashlib.sha256(built_for.encode()).hexdigest()[:12]


NEWEST_ATTENTION = NewestAttentionKernel()
"""The process's C++ kernel (built once per process and CPU model)."""


# `verify_in_pieces` from this many keys before the queries and this many queries (up to
# `kvlab.attention.FOLDED_SCORES_MAX_QUERIES`; longer runs would write out a long causal block). Measured
# on 2 cores of an EPYC (SmolLM2's 3 KV heads of 9 query heads, 2 pieces), per layer at 8064 keys 9 queries
# took 1.60-1.67 ms against 2.11-2.23 written out as matrix products (`folded_scores`), 17 queries 3.05
# against 4.28; at 4096 keys 9 queries 0.92 against 1.24. At 2048 keys and at 2 queries it was no faster.
PIECES_MIN_KEYS = 3072
PIECES_MIN_QUERIES = 3


def key_pieces(kv_heads: int) -> int:
    """Pieces to cut the keys into so that pieces x KV heads spreads evenly over torch's threads
    (1 where the heads already do)."""
    threads = torch.get_num_threads()
    return threads // math.gcd(kv_heads, threads)


def verify_in_pieces(
    folded: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, num_queries: int, pieces: int
) -> torch.Tensor:
    """Causal attention of a row's newest queries, GQA-folded, with the keys every query sees cut into
    `pieces` equal pieces that the flash kernel takes as a batch.

    The keys before the queries, up to a multiple of `pieces`, are views [pieces, H_kv, L, D] of the
    stored keys; the few left over and the queries' own q x q causal block go through `folded_scores`.
    The parts are merged exactly by their log-sum-exp.

    Args:
        folded: [1, H_kv, G*q, D] queries, the G heads of each KV head's group folded into rows.
        keys, values: [1, H_kv, T, D], the queries' own keys last (T - q >= pieces).
        num_queries: q.

    Returns:
        [1, H_kv, G*q, D] float32.
    """
    num_keys = keys.shape[2]
    length = (num_keys - num_queries) // pieces
    split = pieces * length
    piece_keys = keys[0, :, :split].unflatten(1, (pieces, length)).transpose(0, 1)  # [P, H_kv, L, D]
    piece_values = values[0, :, :split].unflatten(1, (pieces, length)).transpose(0, 1)
    outputs, lses = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        folded.expand(pieces, -1, -1, -1), piece_keys, piece_values, 0.0, False, scale=scaling
    )[:2]  # [P, H_kv, G*q, D], [P, H_kv, G*q]
    tail, tail_lse = folded_scores(folded, keys[:, :, split:], values[:, :, split:], scaling, num_queries)
    shares = torch.softmax(torch.cat([lses, tail_lse]), dim=0)  # [P + 1, H_kv, G*q]
    merged = (outputs * shares[:pieces, ..., None]).sum(0, keepdim=True)
    return merged.add_(tail * shares[pieces:, ..., None])


def folded_scores(
    folded: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, num_queries: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of GQA-folded queries [1, H_kv, G*q, D] as written-out float32 matrix products,
    with the log-sum-exp [1, H_kv, G*q] of each row's scores.

    Two batched products over the KV heads, scores in one buffer, the q x q causal block (the last q
    keys) masked by adding -inf in place, the softmax's division moved after the values product (G*q x D
    divisions instead of G*q x T). On 2 threads this beats the flash kernel's split calls, whose
    block-wise parallel regions cost more than their arithmetic at this size.
    """
    kv_heads, rows, dim = folded.shape[1], folded.shape[2], folded.shape[3]
    num_keys = keys.shape[2]
    scores = torch.bmm((folded[0] * scaling), keys[0].transpose(1, 2))  # [H_kv, G*q, T]
    scores[:, :, num_keys - num_queries :].add_(_future_mask(num_queries, rows // num_queries, folded.device))
    top = scores.amax(dim=-1, keepdim=True)
    scores.sub_(top).exp_()
    total = scores.sum(dim=-1, keepdim=True)
    output = (torch.bmm(scores, values[0]) / total).reshape(1, kv_heads, rows, dim)
    return output, (top + total.log()).reshape(1, kv_heads, rows)


def _future_mask(num_queries: int, group: int, device: torch.device) -> torch.Tensor:
    """[G*q, q] float32: -inf where query i (of each of the G folded heads) would see a later key."""
    future = torch.full((num_queries, num_queries), float("-inf"), device=device).triu(1)
    return future.repeat(group, 1)
