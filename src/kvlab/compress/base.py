"""The compressor contract, its registry, and the budget vocabulary every method shares.

A compressor is a dataclass whose fields are its hyper-parameters. It is pure: given one sequence's
keys and values for one layer (and, when it declares so, the queries that produced them), it
returns a `CompressedKV` describing what to store. It never touches a model or a cache object; the
cache layer (`kvlab.cache`) applies the result and keeps decoding on it.

Vocabulary, used everywhere:
- `compression_ratio`: fraction of tokens removed (0 keeps everything);
- `budget`: tokens kept (give one of the two, not both);
- `bits`: bits per stored code for quantizers (16 stores full precision, the identity);
- `kv_bytes_ratio`: full fp16 bytes / stored bytes, a reported figure that counts everything stored.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import torch

from kvlab.errors import ConfigError
from kvlab.registry import Registry, to_dict

compressors: Registry[Compressor] = Registry("compressor")

FP16_BYTES = 2
# Bounds of integer hyper-parameters, so that no parameter (a server request's `drafter_args`
# included) asks for work or memory without limit: token counts (budgets, windows, spans, sinks,
# groups), pooling kernels and seeds.
MAX_TOKENS = 1 << 24
MAX_KERNEL_SIZE = 1023
MAX_SEED = (1 << 32) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class CompressionContext:
    """What a compressor may observe about one layer of one sequence.

    Attributes:
        queries: [H, T_q, D] queries of the prompt's last T_q tokens (rotary applied; T_q = T when the
            prompt was computed whole, fewer when its first tokens' KV was restored from elsewhere),
            or None when the method does not declare `observes_queries`.
        scaling: The attention softmax scale of the layer.
        layer_idx: Index of the layer (some methods vary settings by layer; seeds derive from it).
    """

    queries: torch.Tensor | None
    scaling: float
    layer_idx: int


class CompressedKV(abc.ABC):
    """What a compressor decided to store for one layer of one sequence."""

    @abc.abstractmethod
    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [H_kv, T_stored, D] that attention will read, in the input dtype."""

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of everything this representation stores (codes, scales, indices, full-precision parts)."""


@dataclasses.dataclass
class Compressor(abc.ABC):
    """Base of every method. Subclasses are dataclasses registered in `compressors`.

    Class attributes:
        observes_queries: The method needs the prompt's queries (`CompressionContext.queries`).
        observes_every_query: It scores with the queries of every prompt position, not only of the
            last ones (an observation window): it compresses as meant only a prompt computed whole,
            not KV restored from elsewhere and completed by its last tokens.
    """

    observes_queries: ClassVar[bool] = False
    observes_every_query: ClassVar[bool] = False
    registry_name: ClassVar[str]

    @abc.abstractmethod
    def compress(self, keys: torch.Tensor, values: torch.Tensor, context: CompressionContext) -> CompressedKV:
        """Compress one layer of one sequence.

        Args:
            keys: [H_kv, T, D] keys of the prompt, rotary applied.
            values: [H_kv, T, D].
            context: Observations (see `CompressionContext`).
        """

    def to_dict(self) -> dict[str, object]:
        """`{"name": key, **parameters}`; `compressors.from_dict` rebuilds the method."""
        return to_dict(self)

    def check_prompt(self, num_tokens: int) -> None:  # noqa: B027 - a hook: most methods take any prompt
        """Raise ConfigError if these parameters cannot compress a prompt of `num_tokens` tokens (a
        budget larger than the prompt), so that a server refuses such a request before it runs."""


def check_range(name: str, value: int, low: int, high: int) -> None:
    """Raise ConfigError, naming the parameter, unless `low <= value <= high`."""
    if not low <= value <= high:
        raise ConfigError(f"{name} must be in {low}..{high}, got {value}")


def full_kv_nbytes(num_tokens: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of uncompressed fp16 keys and values: the reference of `kv_bytes_ratio`."""
    return 2 * num_tokens * num_kv_heads * head_dim * FP16_BYTES


def create_compressor(name: str, **params: object) -> Compressor:
    """Build a registered compressor by name, validating parameters (see `kvlab ls`)."""
    return compressors.create(name, **params)
