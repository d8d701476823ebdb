"""vLLM's paged KV block layouts, per attention backend, mapped to kvlab's `[H_kv, T, D]` per layer.

A kvlab chunk holds keys and values as `[L, H_kv, T, D]`; vLLM keeps each layer's KV in pages whose
interior depends on the attention backend (and, on CPU, on the kernel ISA it picked). Each layout
here was checked against the backend's own write kernel (tests/integration/test_vllm_connector.py);
a backend or ISA not listed is refused with `UnknownBlockLayoutError`, never guessed, since reading
a page with the wrong interior gives garbage KV and wrong output.

This module only needs torch, so its mapping is tested without vLLM too.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

from kvlab.errors import KvlabError


class UnknownBlockLayoutError(KvlabError):
    """vLLM chose an attention backend (or kernel variant) whose page interior kvlab has not mapped."""


class BlockLayout(abc.ABC):
    """Reads and writes tokens of one layer's paged KV cache by slot (`block * block_size + offset`)."""

    @abc.abstractmethod
    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[H_kv, T, D]` (copies) of the tokens at `slots` `[T]` int64."""

    @abc.abstractmethod
    def scatter(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys and values `[H_kv, T, D]` into the tokens at `slots` `[T]` int64, in place."""


@dataclasses.dataclass(frozen=True, slots=True)
class CPUTransposedKeyLayout(BlockLayout):
    """vLLM's CPU_ATTN pages with the `vec`/`vec16` kernels.

    A layer is `[num_blocks, H_kv, N, 2 * D]` (N = block_size); each (block, head) is one contiguous
    span of `2 * N * D` elements holding the keys transposed, `[D, N]`, then the values, `[N, D]`.
    """

    def _split(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks, num_heads, block_size, twice_head_dim = kv_cache.shape
        head_dim = twice_head_dim // 2
        spans = kv_cache.view(num_blocks, num_heads, 2 * block_size * head_dim)
        keys_t = spans[..., : block_size * head_dim].view(num_blocks, num_heads, head_dim, block_size)
        values = spans[..., block_size * head_dim :].view(num_blocks, num_heads, block_size, head_dim)
        return keys_t, values

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys_t, values = self._split(kv_cache)
        block_size = kv_cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        # [T, H, D] from advanced indexing over (block, offset), then heads first.
        keys = keys_t[blocks, :, :, offsets].permute(1, 0, 2).contiguous()
        return keys, values[blocks, :, offsets].permute(1, 0, 2).contiguous()

    def scatter(self, kv_cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        keys_t, paged_values = self._split(kv_cache)
        block_size = kv_cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        keys_t[blocks, :, :, offsets] = keys.permute(1, 0, 2).to(kv_cache.dtype)
        paged_values[blocks, :, offsets] = values.permute(1, 0, 2).to(kv_cache.dtype)


# (backend name, CPU kernel ISA or None) -> layout. Only entries verified against the backend's kernel.
LAYOUTS: dict[tuple[str, str | None], BlockLayout] = {
    ("CPU_ATTN", "vec"): CPUTransposedKeyLayout(),
    ("CPU_ATTN", "vec16"): CPUTransposedKeyLayout(),
}


def block_layout(backend: str, isa: str | None = None) -> BlockLayout:
    """The layout of `backend`'s pages (with `isa`, the CPU kernel variant), or UnknownBlockLayoutError."""
    layout = LAYOUTS.get((backend, isa))
    if layout is None:
        known = ", ".join(f"{name}/{variant}" if variant else name for name, variant in sorted(LAYOUTS, key=str))
        raise UnknownBlockLayoutError(
            f"kvlab has no mapping of vLLM's {backend}{'/' + isa if isa else ''} KV block layout (mapped: {known}); "
            "run vLLM without KVLabConnector, or add the layout in kvlab.integrations.vllm.layouts with a test "
            "against the backend's write kernel"
        )
    return layout


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots `[end - start]` int64 of a request's tokens `start:end`, given its block table."""
    positions = torch.arange(start, end)
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size
