"""`KVLabConnector`: vLLM's prompt-prefix KV saved to and restored from any kvlab store.

Chunks are kvlab's own (`kvlab.store.prefix`): keys chain the prompt's token hashes under the
model's identity, values are `[L, H_kv, T, D]` keys and values through kvlab's codecs, so a prefix
saved by vLLM is reused by `kvlab generate --prefix-store` on the same checkpoint and vice versa.

Where the work happens:
- Scheduler: `get_num_new_matched_tokens` starts the whole fetch (lookup, transfer, decoding, checks:
  `PrefixCache.fetch`) on a background thread and answers "not yet" (None) until it ends, so the
  scheduler keeps serving other requests meanwhile. It then offers vLLM exactly the tokens that
  arrived intact: every fault (missing, corrupted, foreign or unauthenticated chunk, store down)
  has already shortened the prefix, with one log line, and vLLM computes the rest itself.
- Worker: before each attention layer runs (`wait_for_layer_load`) the restored keys and values of
  that layer are written into its pages; after the last layer (`save_kv_layer`) the step's rows and
  pages are handed to `KVLabDraftProposer` in the same process (`kvlab.integrations.vllm.handover`),
  so the drafter reads the target's KV instead of computing it again; after the step
  (`wait_for_save`) the prompt's newly completed chunks are copied out of the pages and written by a
  background thread.

Configuration is `kv_connector_extra_config`: `store` (a kvlab store URL) plus any `PrefixConfig`
field (`chunk_tokens`, `write`, `fetch`, `allow_recompute`, `cache_salt`, ...). Unknown keys are errors.
Without `store` the connector only hands KV over to the proposer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index

from kvlab.errors import ConfigError
from kvlab.integrations.vllm.handover import (
    BOARD,
    ScheduledRequest,
    StepHandover,
    engine_key,
    rows_of_step,
)
from kvlab.integrations.vllm.layouts import BlockLayout, UnknownBlockLayoutError, block_layout, slots_of
from kvlab.integrations.vllm.model import prefix_parameters, served_model
from kvlab.store import create_store
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.prefix.fetched import FetchedPrefix

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# How long one scheduling pass waits for a fetch in flight before answering "not yet": long enough
# that an idle engine does not spin on the scheduler, short enough not to hold other requests back.
_FETCH_POLL_S = 0.05


@dataclasses.dataclass(slots=True)
class LoadSpec:
    """Restored KV a worker writes into a request's pages before this step's forward.

    Attributes:
        block_ids: The request's block table (its first KV cache group).
        start: First token to write (vLLM's own prefix cache already holds the ones before).
        keys: [L, H_kv, T, D] keys of tokens `start:start + T`; `values` likewise.
    """

    block_ids: list[int]
    start: int
    keys: torch.Tensor
    values: torch.Tensor


@dataclasses.dataclass(slots=True)
class SaveSpec:
    """Complete prompt chunks a worker copies out of a request's pages after this step.

    Attributes:
        prompt_token_ids: The whole prompt (chunk keys hash every token up to a chunk's end).
        block_ids: The request's block table.
        start: First token to save (a chunk boundary); `end` is past the last one (also one).
    """

    prompt_token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int


@dataclasses.dataclass
class KVLabConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the workers for one step."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    saves: list[SaveSpec] = dataclasses.field(default_factory=list)
    scheduled: list[ScheduledRequest] = dataclasses.field(default_factory=list)
    finished: frozenset[str] = frozenset()


@dataclasses.dataclass(slots=True)
class _Tracked:
    """A running request's prompt, block table and how far its chunks are saved (scheduler side)."""

    prompt_token_ids: list[int]
    block_ids: list[int]
    saved_until: int


def prefix_cache_for(vllm_config: VllmConfig) -> PrefixCache | None:
    """The kvlab prefix cache `kv_connector_extra_config` describes, for the model vLLM serves (None:
    no `store`, the connector only hands KV over to the proposer)."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    url = extra.pop("store", None)
    allowed = ["store", *(f.name for f in dataclasses.fields(PrefixConfig))]
    unknown = sorted(set(extra) - set(allowed))
    if unknown or (url is None and extra) or (url is not None and not isinstance(url, str)):
        problem = f"unknown key {unknown[0]!r}" if unknown else "no 'store' URL for the prefix settings"
        raise ConfigError(f"KVLabConnector: {problem} in kv_connector_extra_config; keys: {', '.join(allowed)}")
    if url is None:
        return None
    for name in ("write", "fetch"):
        if name in extra:
            extra[name] = tuple(extra[name])
    if url.startswith("memory://") and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        # Found under `vllm serve`: the same prompt sent twice restored nothing with memory://, 192 tokens
        # with file://.
        logger.warning("KVLabConnector: %s lives in one process, but this vLLM runs the connector's scheduler "
                       "side (which fetches) and worker side (which saves) in separate ones: nothing saved will "
                       "be restored; use a file:// or redis:// store", url)
    config = PrefixConfig(**extra)
    directory, dtype = served_model(vllm_config)
    identity, raw_bytes_per_token, geometry = prefix_parameters(directory, dtype, config.chunk_tokens)
    return PrefixCache(create_store(url), identity, raw_bytes_per_token, config, geometry)


class KVLabConnector(KVConnectorBase_V1):
    """vLLM KV connector (V1) over kvlab stores and codecs; see the module docstring.

    Store faults are handled before vLLM is told how many tokens to load, so vLLM's own load-failure
    handling (`kv_load_failure_policy`) never comes into play.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.prefix = prefix_cache_for(vllm_config)
        if self.prefix is not None and self.prefix.chunk_tokens % self.block_size:
            raise ConfigError(f"KVLabConnector: chunk_tokens={self.prefix.chunk_tokens} must be a multiple of "
                              f"vLLM's block_size={self.block_size}")
        # Scheduler side.
        self._fetcher = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlab-fetch")
        self._fetches: dict[str, concurrent.futures.Future[FetchedPrefix]] = {}
        self._fetched: dict[str, tuple[int, FetchedPrefix]] = {}
        self._loads: dict[str, tuple[int, FetchedPrefix]] = {}
        self._tracked: dict[str, _Tracked] = {}
        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._layout: BlockLayout | None = None
        self._pending: list[LoadSpec] = []
        # The hand-over to the proposer: one KV cache group only (a model with sliding-window layers has
        # several block tables; the proposer then prefills prompts itself).
        self._engine = engine_key(vllm_config)
        self._hands_over = len(kv_cache_config.kv_cache_groups) == 1 if kv_cache_config is not None else False
        self._last_layer = -1

    # ----- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past `num_computed_tokens` restored intact from the store; None while the fetch runs."""
        req_id = request.request_id
        prompt = list(request.prompt_token_ids or [])
        if self.prefix is None or getattr(request, "skip_reading_prefix_cache", False) or \
                self.prefix.reusable_chunks(len(prompt)) * self.prefix.chunk_tokens <= num_computed_tokens:
            # vLLM would discard the count for a request that skips prefix caches: fetch nothing.
            return 0, False
        if req_id not in self._fetched:
            future = self._fetches.get(req_id)
            if future is None:
                future = self._fetches[req_id] = self._fetcher.submit(self.prefix.fetch, prompt)
            try:
                fetched = future.result(timeout=_FETCH_POLL_S)
            except concurrent.futures.TimeoutError:
                return None, False
            del self._fetches[req_id]
            self._fetched[req_id] = (num_computed_tokens, fetched)
        _, fetched = self._fetched[req_id]
        self._fetched[req_id] = (num_computed_tokens, fetched)
        return max(0, fetched.end - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        entry = self._fetched.pop(request.request_id, None)
        if entry is not None and num_external_tokens > 0:
            self._loads[request.request_id] = entry

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVLabConnectorMetadata(finished=frozenset(scheduler_output.finished_req_ids))
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or [])
            tracked = self._tracked[new.req_id] = _Tracked(prompt, list(new.block_ids[0]), 0)
            self._add_load(meta, new.req_id, tracked)
            self._add_save(meta, tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0))
            self._add_scheduled(meta, new.req_id, tracked, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked_or_none = self._tracked.get(req_id)
            if tracked_or_none is None:
                continue
            new_block_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # A resumed request gets its whole (new) block table and recomputes or reloads everything.
                tracked_or_none.block_ids = list(new_block_ids[0]) if new_block_ids else []
            elif new_block_ids:
                tracked_or_none.block_ids.extend(new_block_ids[0])
            self._add_load(meta, req_id, tracked_or_none)
            self._add_save(meta, tracked_or_none, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
            self._add_scheduled(meta, req_id, tracked_or_none, cached.num_computed_tokens[i])
        return meta

    def _add_scheduled(self, meta: KVLabConnectorMetadata, req_id: str, tracked: _Tracked, num_computed: int) -> None:
        """Name the block of the request's first token this step: the workers match batch rows by it."""
        index = num_computed // self.block_size
        if index < len(tracked.block_ids):
            meta.scheduled.append(ScheduledRequest(req_id, tracked.block_ids[index]))

    def _add_load(self, meta: KVLabConnectorMetadata, req_id: str, tracked: _Tracked) -> None:
        entry = self._loads.pop(req_id, None)
        if entry is None:
            return
        local, fetched = entry
        keys = torch.cat([k for k, _ in fetched.chunks], dim=2)[:, :, local:]
        values = torch.cat([v for _, v in fetched.chunks], dim=2)[:, :, local:]
        meta.loads.append(LoadSpec(list(tracked.block_ids), local, keys, values))
        # Restored chunks are in the store already.
        tracked.saved_until = max(tracked.saved_until, fetched.end)

    def _add_save(self, meta: KVLabConnectorMetadata, tracked: _Tracked, num_computed: int) -> None:
        if self.prefix is None or not self.prefix.config.write:
            return
        size = self.prefix.chunk_tokens
        end = min(num_computed, len(tracked.prompt_token_ids)) // size * size
        if end > tracked.saved_until:
            meta.saves.append(SaveSpec(tracked.prompt_token_ids, list(tracked.block_ids), tracked.saved_until, end))
            tracked.saved_until = end

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its saves were copied out of its pages within their step (blocks free now)."""
        req_id = request.request_id
        for table in (self._tracked, self._fetched, self._loads):
            table.pop(req_id, None)
        future = self._fetches.pop(req_id, None)
        if future is not None:
            future.cancel()
        return False, None

    # ----- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layer_index = {name: extract_layer_index(name) for name in kv_caches}
        self._last_layer = max(self._layer_index.values(), default=-1)
        if not self._hands_over:
            logger.info("KVLabConnector hands no KV to the proposer: the model has %d KV cache groups",
                        len(self._kv_cache_config.kv_cache_groups))
            return
        try:
            self._page_layout()
        except (UnknownBlockLayoutError, ConfigError) as error:
            logger.warning("KVLabConnector hands no KV to the proposer: %s", error)
            self._hands_over = False
            return
        BOARD.connect(self._engine)

    def _page_layout(self) -> BlockLayout:
        """The layout of this engine's pages, from the backend (and CPU kernel ISA) of its attention layers."""
        if self._layout is None:
            layers = self._vllm_config.compilation_config.static_forward_context
            variants = set()
            for name in self._kv_caches:
                layer = layers[name]
                variants.add((layer.attn_backend.get_name(), getattr(layer, "isa", None)))
            if len(variants) != 1:
                raise ConfigError(
                    f"KVLabConnector: attention layers use several page layouts {sorted(variants, key=str)}"
                )
            self._layout = block_layout(*variants.pop())
        return self._layout

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Queue this step's restored prefixes; each layer's part is written as that layer starts."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVLabConnectorMetadata)
        self._pending = list(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._pending or layer_name not in self._kv_caches:
            return
        layout, kv_cache, index = self._page_layout(), self._kv_caches[layer_name], self._layer_index[layer_name]
        for load in self._pending:
            slots = slots_of(load.block_ids, self.block_size, load.start, load.start + load.keys.shape[2])
            layout.scatter(kv_cache, slots.to(kv_cache.device), load.keys[index], load.values[index])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """After the last layer, hand the step's KV to the proposer (vLLM may run the proposer before
        `wait_for_save`); chunks hold every layer, so they are copied out in `wait_for_save`."""
        if not self._hands_over or self._layer_index.get(layer_name) != self._last_layer:
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVLabConnectorMetadata)
        rows = rows_of_step(attn_metadata, metadata.scheduled, self.block_size)
        names = sorted(self._kv_caches, key=self._layer_index.__getitem__)
        pages = [self._kv_caches[name] for name in names]
        BOARD.publish(self._engine, StepHandover(rows, pages, self._page_layout(), self.block_size, metadata.finished))

    def wait_for_save(self) -> None:
        """Copy the step's completed prompt chunks out of the pages (every layer) and queue their writes."""
        self._pending = []
        if not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVLabConnectorMetadata)
        if not metadata.saves or self.prefix is None:
            return
        layout = self._page_layout()
        names = sorted(self._kv_caches, key=self._layer_index.__getitem__)
        for save in metadata.saves:
            slots = slots_of(save.block_ids, self.block_size, save.start, save.end)
            layer_kv = []
            for name in names:
                keys, values = layout.gather(self._kv_caches[name], slots.to(self._kv_caches[name].device))
                layer_kv.append((keys[None], values[None]))
            self.prefix.save(save.prompt_token_ids, save.start, layer_kv)

    def shutdown(self) -> None:
        """Finish queued writes (a write that fails was logged by the writer; vLLM is shutting down)."""
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        BOARD.disconnect(self._engine)
        if self.prefix is None:
            return
        try:
            self.prefix.close()
        except Exception as error:  # shutting down: report, never raise
            logger.warning("kvlab store writes did not all finish at shutdown: %s", error)
