"""KVLabConnector inside a real vLLM engine (runs in .venv-vllm): restored prefixes give identical
output, every store fault falls back to compute with one log line, chunks are shared with kvlab's
own prefix store, and vLLM's page layouts are mapped explicitly."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvlab.data import document_token_ids
from kvlab.engine import generate
from kvlab.generation import GenerationConfig
from kvlab.integrations.vllm.layouts import (
    LAYOUTS,
    CPUTransposedKeyLayout,
    UnknownBlockLayoutError,
    block_layout,
    slots_of,
)
from kvlab.integrations.vllm.model import model_directory, prefix_parameters
from kvlab.models import LoadedModel, load_model
from kvlab.store import KVStore, create_store
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.resolution import RESOLUTIONS, encode_chunk
from tests.helpers import RedisServer
from tests.integration.vllm.engines import BLOCK_SIZE, greedy, make_engine, wait_until_stored

pytestmark = pytest.mark.integration
vllm = pytest.importorskip("vllm", reason="the vLLM integration tests run in .venv-vllm (make test-vllm)")

CHUNK = 64
PROMPT_TOKENS = 200  # three complete chunks (192 tokens) are reusable, the rest is computed


@pytest.fixture(scope="module")
def redis_store_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("vllm-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def engine(redis_store_server: RedisServer) -> Iterator[object]:
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="KVLabConnector", kv_connector_module_path="kvlab.integrations.vllm", kv_role="kv_both",
        kv_connector_extra_config={"store": redis_store_server.url + "?timeout=0.5", "chunk_tokens": CHUNK,
                                   "allow_recompute": False},
    )
    llm = make_engine(kv_transfer_config=transfer)
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def document() -> list[int]:
    from transformers import AutoTokenizer

    return document_token_ids(AutoTokenizer.from_pretrained(model_directory()), 8 * PROMPT_TOKENS)


def prompt_number(document: list[int], index: int) -> list[int]:
    """A distinct prompt per test, so no test finds another's chunks."""
    return document[index * PROMPT_TOKENS : (index + 1) * PROMPT_TOKENS]


@pytest.fixture
def store(redis_store_server: RedisServer) -> Iterator[KVStore]:
    opened = create_store(redis_store_server.url)
    yield opened
    opened.close()


def prefix_cache(store: KVStore) -> PrefixCache:
    """kvlab's own prefix cache for the served checkpoint, on the same store and chunking as the engine."""
    identity, raw_bytes_per_token, geometry = prefix_parameters(model_directory(), "float32", CHUNK)
    return PrefixCache(store, identity, raw_bytes_per_token, PrefixConfig(CHUNK, allow_recompute=False), geometry)


def saved(engine: object, store: KVStore, prompt: list[int]) -> tuple[list[int], list[str]]:
    """Output of a first request for `prompt` (computed, nothing stored yet) and its three chunk keys."""
    tokens, reused = greedy(engine, prompt)
    assert reused == 0, "a fresh prompt found stored chunks"
    keys = prefix_cache(store).keys(prompt, "exact")
    missing = wait_until_stored(store, keys)
    assert not missing, f"chunks {missing} were never saved"
    return tokens, keys


def kvlab_store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "kvlab.store"]


# ----- layouts


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_layout_reads_and_writes_what_the_cpu_kernel_writes(isa: str) -> None:
    from vllm import _custom_ops as ops

    num_blocks, num_heads, head_dim, num_tokens = 5, 3, 64, 70
    kv_cache = torch.zeros(num_blocks, num_heads, BLOCK_SIZE, 2 * head_dim)
    key_pages, value_pages = kv_cache.view(num_blocks, num_heads, 2 * BLOCK_SIZE, head_dim).chunk(2, dim=2)
    keys = torch.randn(num_tokens, num_heads, head_dim)
    values = torch.randn(num_tokens, num_heads, head_dim)
    slots = slots_of([3, 1, 4], BLOCK_SIZE, 5, 5 + num_tokens)
    ops.cpu_attn_reshape_and_cache(keys, values, key_pages, value_pages, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    layout = block_layout("CPU_ATTN", isa)
    read_keys, read_values = layout.gather(kv_cache, slots)
    assert torch.equal(read_keys, keys.permute(1, 0, 2)) and torch.equal(read_values, values.permute(1, 0, 2))
    rewritten = torch.zeros_like(kv_cache)
    layout.scatter(rewritten, slots, read_keys, read_values)
    assert torch.equal(rewritten, kv_cache), f"{isa}: scatter does not place tokens where the kernel does"


def test_the_engine_runs_a_mapped_layout(engine: object) -> None:
    layers = engine.llm_engine.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
    picked = {(layer.attn_backend.get_name(), getattr(layer, "isa", None)) for layer in layers.values()}
    assert picked and picked <= set(LAYOUTS), f"vLLM picked {picked}; mapped: {sorted(LAYOUTS, key=str)}"


def test_an_unknown_layout_is_refused() -> None:
    with pytest.raises(UnknownBlockLayoutError, match="FLASH_ATTN"):
        block_layout("FLASH_ATTN")
    with pytest.raises(UnknownBlockLayoutError, match="CPU_ATTN/amx"):
        block_layout("CPU_ATTN", "amx")
    assert isinstance(block_layout("CPU_ATTN", "vec"), CPUTransposedKeyLayout)


# ----- reuse


def test_a_restored_prefix_gives_identical_output(engine: object, store: KVStore, document: list[int]) -> None:
    prompt = prompt_number(document, 0)
    first, _ = saved(engine, store, prompt)
    again, reused = greedy(engine, prompt)
    computed, not_read = greedy(engine, prompt, read_store=False)
    assert reused == 3 * CHUNK and not_read == 0
    assert again == first == computed


def test_the_restored_kv_is_what_the_engine_attends_to(engine: object, store: KVStore, document: list[int]) -> None:
    prompt = prompt_number(document, 1)
    prefix, geometry = prefix_cache(store), prefix_parameters(model_directory(), "float32", CHUNK)[2]
    zeros = torch.zeros(geometry.num_layers, geometry.num_kv_heads, CHUNK, geometry.head_dim)
    for key in prefix.keys(prompt, "exact"):
        store.put(key, encode_chunk(RESOLUTIONS["exact"], zeros, zeros))
    damaged, reused = greedy(engine, prompt)
    computed, _ = greedy(engine, prompt, read_store=False)
    assert reused == 3 * CHUNK and damaged != computed, "zeroed KV in the store left the output unchanged"


# ----- faults: each ends the restored prefix early, vLLM computes the rest, output is identical


def test_a_corrupted_chunk_is_recomputed_with_one_log_line(
    engine: object, store: KVStore, document: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    prompt = prompt_number(document, 2)
    first, keys = saved(engine, store, prompt)
    data = bytearray(store.get(keys[1]) or b"")
    data[len(data) // 2] ^= 0x10
    store.put(keys[1], bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        output, reused = greedy(engine, prompt)
    assert (output, reused) == (first, CHUNK)
    assert len(kvlab_store_warnings(caplog)) == 1, kvlab_store_warnings(caplog)


def test_a_missing_chunk_ends_the_prefix(engine: object, store: KVStore, document: list[int]) -> None:
    prompt = prompt_number(document, 3)
    first, keys = saved(engine, store, prompt)
    store.delete(keys[2])
    assert greedy(engine, prompt) == (first, 2 * CHUNK)


def test_a_foreign_chunk_is_refused_with_one_log_line(
    engine: object, store: KVStore, document: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    prompt = prompt_number(document, 4)
    first, keys = saved(engine, store, prompt)
    foreign = torch.randn(2, 4, CHUNK, 32)  # another model's geometry under this model's key
    store.put(keys[0], encode_chunk(RESOLUTIONS["exact"], foreign, foreign))
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        output, reused = greedy(engine, prompt)
    assert (output, reused) == (first, 0)
    assert len(kvlab_store_warnings(caplog)) == 1, kvlab_store_warnings(caplog)


# ----- one chunk format with kvlab generate --prefix-store


@pytest.fixture(scope="module")
def kvlab_model() -> LoadedModel:
    return load_model(model_directory())


def test_chunks_kvlab_saved_are_reused_by_vllm(
    engine: object, store: KVStore, document: list[int], kvlab_model: LoadedModel
) -> None:
    prompt = prompt_number(document, 5)
    prefix = PrefixCache.for_model(kvlab_model, store, PrefixConfig(CHUNK, allow_recompute=False))
    expected = generate(kvlab_model, [prompt], GenerationConfig(max_new_tokens=12, ignore_eos=True), prefix=prefix)
    prefix.close()
    output, reused = greedy(engine, prompt)
    assert reused == 3 * CHUNK
    assert output == expected.requests[0].token_ids == greedy(engine, prompt, read_store=False)[0]


def test_chunks_vllm_saved_are_reused_by_kvlab(
    engine: object, store: KVStore, document: list[int], kvlab_model: LoadedModel
) -> None:
    prompt = prompt_number(document, 6)
    first, _ = saved(engine, store, prompt)
    prefix = PrefixCache.for_model(kvlab_model, store, PrefixConfig(CHUNK, allow_recompute=False, write=()))
    output = generate(kvlab_model, [prompt], GenerationConfig(max_new_tokens=12, ignore_eos=True), prefix=prefix)
    assert output.stats.prefix_reused_tokens == 3 * CHUNK
    assert output.requests[0].token_ids == first


# ----- last: the store goes away


def test_a_store_that_goes_down_is_skipped_with_one_log_line(
    engine: object, redis_store_server: RedisServer, document: list[int], caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    prompt = prompt_number(document, 7)
    store = create_store(redis_store_server.url)
    first, _ = saved(engine, store, prompt)
    redis_store_server.stop()
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        output, reused = greedy(engine, prompt)
        again, reused_again = greedy(engine, prompt)
    assert (output, reused) == (first, 0) and (again, reused_again) == (first, 0)
    assert len(kvlab_store_warnings(caplog)) == 1, kvlab_store_warnings(caplog)


def test_without_a_store_the_connector_only_hands_over_and_prefix_settings_need_one() -> None:
    import types

    from kvlab.errors import ConfigError
    from kvlab.integrations.vllm.connector import prefix_cache_for

    def config(extra: dict[str, object]) -> object:
        return types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra))

    assert prefix_cache_for(config({})) is None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no 'store' URL for the prefix settings"):
        prefix_cache_for(config({"chunk_tokens": 64}))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown key 'stor'"):
        prefix_cache_for(config({"stor": "redis://x"}))  # type: ignore[arg-type]


@pytest.mark.parametrize(("multiprocessing", "scheme", "warned"),
                         [("1", "memory", True), ("0", "memory", False), ("1", "file", False)])
def test_a_process_local_store_where_vllm_runs_the_connector_in_two_processes_says_nothing_will_be_restored(
    multiprocessing: str, scheme: str, warned: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import types

    from kvlab.integrations.vllm.connector import prefix_cache_for

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
    url = "memory://" if scheme == "memory" else f"file://{tmp_path}"
    config = types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config={"store": url}),
        model_config=types.SimpleNamespace(model=model_directory(), dtype=torch.float32),
    )
    with caplog.at_level(logging.WARNING, logger="kvlab.integrations.vllm.connector"):
        assert prefix_cache_for(config) is not None  # type: ignore[arg-type]
    said = [record.getMessage() for record in caplog.records if "nothing saved will be restored" in record.getMessage()]
    assert len(said) == int(warned), said
