"""The target's KV handed from `KVLabConnector` to `KVLabDraftProposer` inside one vLLM worker process.

vLLM gives a `custom_class` proposer token ids only. The connector's worker side, in the same process,
sees each step's attention metadata (every batch row's block table and length, in the order the
proposer's rows come in) and every layer's pages; the scheduler side tells it which request each row
is. After each forward the connector publishes a `StepHandover` on the board of its engine; the
proposer takes it in the same step and reads the prompt's and the verified tokens' KV from the pages
instead of computing them again.

A row is matched to its request by the block that holds the request's first token scheduled this
step: vLLM writes a step's tokens into blocks only that request holds (shared prefix blocks are full
and never written), so the block is the request's own.

This module needs only torch, so its logic is tested without vLLM.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from kvlab.integrations.vllm.layouts import BlockLayout, slots_of

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """A request scheduled in a step, as the scheduler side tells the workers.

    Attributes:
        req_id: vLLM's request id.
        first_block: The block holding the request's first token computed this step.
    """

    req_id: str
    first_block: int


@dataclasses.dataclass(frozen=True, slots=True)
class HandedRow:
    """One batch row of a step: its request and where its KV lies.

    Attributes:
        req_id: The row's request (None: no scheduled request owns the row's first block).
        block_ids: [num_blocks] int64 block table of the row, as the attention kernel read it.
        num_tokens: Tokens whose KV the pages hold after the step (rejected drafts' KV included).
    """

    req_id: str | None
    block_ids: torch.Tensor
    num_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class StepHandover:
    """What one step left in vLLM's pages, per batch row, for the proposer of the same step.

    Attributes:
        rows: One per batch row, in the order of the proposer's rows.
        pages: Per model layer (in layer order), vLLM's paged KV tensor of that layer.
        layout: How a page's interior is laid out (`kvlab.integrations.vllm.layouts`).
        block_size: Tokens per block.
        finished: Requests that ended since the previous step (their draft caches can go).
    """

    rows: list[HandedRow]
    pages: list[torch.Tensor]
    layout: BlockLayout
    block_size: int
    finished: frozenset[str] = frozenset()

    def gather(self, row: int, start: int, end: int) -> LayerKV:
        """Per layer, ([1, H_kv, end - start, D] keys, values) of batch row `row`'s tokens `start:end`."""
        handed = self.rows[row]
        if not 0 <= start <= end <= handed.num_tokens:
            raise ValueError(f"row {row} holds {handed.num_tokens} tokens' KV, not {start}:{end}")
        slots = slots_of(handed.block_ids.tolist(), self.block_size, start, end)
        layer_kv = []
        for page in self.pages:
            keys, values = self.layout.gather(page, slots.to(page.device))
            layer_kv.append((keys[None], values[None]))
        return layer_kv


def rows_of_step(
    attn_metadata: Any, scheduled: list[ScheduledRequest], block_size: int
) -> list[HandedRow]:
    """The batch rows of a step from vLLM's attention metadata (`query_start_loc`, `seq_lens`,
    `block_table`, `slot_mapping`, rows in batch order) and the scheduler's requests."""
    owner = {request.first_block: request.req_id for request in scheduled}
    starts = attn_metadata.query_start_loc.tolist()
    lengths = attn_metadata.seq_lens.tolist()
    slot_mapping = attn_metadata.slot_mapping
    rows = []
    for row, num_tokens in enumerate(lengths[: len(starts) - 1]):
        first_block = int(slot_mapping[starts[row]]) // block_size
        num_blocks = -(-int(num_tokens) // block_size)
        block_ids = attn_metadata.block_table[row, :num_blocks].to(torch.long).cpu()
        rows.append(HandedRow(owner.get(first_block), block_ids, int(num_tokens)))
    return rows


class HandoverBoard:
    """The latest step's hand-over of each engine in this process, keyed by the engine's instance id.

    `connect` marks an engine whose connector hands KV over (so a proposer that finds no step knows
    whether it is missing or was never coming); `publish` replaces the engine's step; `take` returns
    it once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connected: set[str] = set()
        self._steps: dict[str, StepHandover] = {}

    def connect(self, engine: str) -> None:
        with self._lock:
            self._connected.add(engine)

    def disconnect(self, engine: str) -> None:
        with self._lock:
            self._connected.discard(engine)
            self._steps.pop(engine, None)

    def connected(self, engine: str) -> bool:
        with self._lock:
            return engine in self._connected

    def publish(self, engine: str, step: StepHandover) -> None:
        with self._lock:
            previous = self._steps.get(engine)
            if previous is not None and previous.finished:
                # A step no proposer took still carries finished requests; the next one must too.
                step = dataclasses.replace(step, finished=previous.finished | step.finished)
            self._steps[engine] = step

    def take(self, engine: str) -> StepHandover | None:
        with self._lock:
            return self._steps.pop(engine, None)


BOARD = HandoverBoard()


def engine_key(vllm_config: Any) -> str:
    """The board key of the engine a vLLM config belongs to (its connector and proposer share it)."""
    return str(getattr(vllm_config, "instance_id", "") or id(vllm_config))
