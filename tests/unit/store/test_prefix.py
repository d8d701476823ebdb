"""Prefix reuse: restored prefixes give the logits of full recomputation, and every fault falls back to it."""

from __future__ import annotations

import logging

import pytest
import torch

from kvlab.compress import create_compressor
from kvlab.engine import generate, generate_lossless
from kvlab.generation.config import GenerationConfig
from kvlab.generation.prefill import PrefillCaches, PrefixReuse, prefill
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel
from kvlab.store import KVStore, StoreUnavailableError, create_store
from kvlab.store.backends.link import ThrottledStore
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.resolution import RESOLUTIONS, decode_chunk, encode_chunk
from tests.helpers import RedisServer, tiny_llama

CHUNK = 16
PROMPT = [(7 * i + 3) % 90 + 3 for i in range(75)]  # 4 complete chunks + 11 tokens
OTHER_SUFFIX = [5, 9, 4, 33, 17]


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=3)


def make_cache(model: LoadedModel, store: KVStore | str = "memory://", **overrides: object) -> PrefixCache:
    # A tiny model recomputes faster than anything decodes: the planner would (rightly) recompute, so
    # these tests pin fetching on; the planner's choice is tested in test_planner.py.
    config = PrefixConfig(chunk_tokens=CHUNK, allow_recompute=False, **overrides)  # type: ignore[arg-type]
    return PrefixCache.for_model(model, store, config)


def reference(model: LoadedModel, prompt: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Keys of every layer and last logits, computing every prompt token (in the store's chunks)."""
    cache, _, logits = prefill(model, [prompt], PrefillCaches(len(prompt) + 4), chunk_tokens=CHUNK)
    return [layer.keys[:, :, : len(prompt)] for layer in cache.layers], logits


def restored(
    model: LoadedModel,
    prompt: list[int],
    prefix: PrefixCache,
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    from kvlab.generation.outputs import GenerationStats

    stats = GenerationStats()
    cache, _, logits = prefill(model, [prompt], PrefillCaches(len(prompt) + 4), PrefixReuse(prefix, stats=stats))
    return [layer.keys[:, :, : len(prompt)] for layer in cache.layers], logits, stats.prefix_reused_tokens


@pytest.mark.parametrize("resolution", ["exact", "raw"])
def test_fetched_prefix_then_continue_equals_recompute(model: LoadedModel, resolution: str) -> None:
    prefix = make_cache(model, write=(resolution,), fetch=(resolution,))
    restored(model, PROMPT, prefix)  # fills the store
    prefix.flush()
    prompt = PROMPT + OTHER_SUFFIX
    keys, logits, reused = restored(model, prompt, prefix)
    expected_keys, expected_logits = reference(model, prompt)
    assert reused == 4 * CHUNK
    assert torch.equal(logits, expected_logits)
    assert all(torch.equal(a, b) for a, b in zip(keys, expected_keys, strict=True))


def test_a_prompt_that_is_all_chunks_still_computes_its_last_token(model: LoadedModel) -> None:
    prompt = PROMPT[: 4 * CHUNK]
    prefix = make_cache(model)
    restored(model, prompt, prefix)
    prefix.flush()
    _, logits, reused = restored(model, prompt, prefix)
    assert reused == 3 * CHUNK  # the last chunk holds the token whose logits start generation
    assert torch.equal(logits, reference(model, prompt)[1])


def test_reuse_stops_where_prompts_diverge(model: LoadedModel) -> None:
    prefix = make_cache(model)
    restored(model, PROMPT, prefix)
    prefix.flush()
    diverging = PROMPT[: 2 * CHUNK + 3] + [95] + PROMPT[2 * CHUNK + 4 :]
    _, logits, reused = restored(model, diverging, prefix)
    assert reused == 2 * CHUNK
    assert torch.equal(logits, reference(model, diverging)[1])


def test_keys_depend_on_the_model(model: LoadedModel) -> None:
    other = tiny_llama(num_kv_heads=2, seed=4)
    assert make_cache(model).keys(PROMPT, "exact") != make_cache(other).keys(PROMPT, "exact")


def test_generation_with_a_prefix_store_is_identical(model: LoadedModel) -> None:
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    prompts = [PROMPT, PROMPT[:40] + OTHER_SUFFIX]
    expected = [r.token_ids for r in generate(model, prompts, config).requests]
    prefix = make_cache(model)
    first = generate(model, prompts, config, prefix=prefix)
    prefix.flush()
    second = generate(model, prompts, config, prefix=prefix)
    assert [r.token_ids for r in first.requests] == expected
    assert [r.token_ids for r in second.requests] == expected
    # The second prompt may already reuse the chunks the first one saved (the writer runs alongside).
    assert first.stats.prefix_reused_tokens in (0, 2 * CHUNK)
    assert second.stats.prefix_reused_tokens == 4 * CHUNK + 2 * CHUNK


@pytest.mark.parametrize("drafter", ["snapkv", "kivi"])
def test_lossless_decoding_with_a_prefix_store_is_identical(model: LoadedModel, drafter: str) -> None:
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    expected = generate(model, [PROMPT], config).requests[0].token_ids
    prefix = make_cache(model)
    spec = LosslessConfig(create_compressor(drafter), num_draft_tokens=4)
    generate_lossless(model, [PROMPT], config, spec, prefix=prefix)
    prefix.flush()
    output = generate_lossless(model, [PROMPT], config, spec, prefix=prefix)
    assert output.requests[0].token_ids == expected and output.stats.prefix_reused_tokens == 4 * CHUNK


def test_lossless_decoding_restores_its_verifier_from_exact_chunks_only(model: LoadedModel) -> None:
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    expected = generate(model, [PROMPT], config).requests[0].token_ids
    # A store configured to fetch int4 when it is cheaper, as it is on the (assumed) slow link at first.
    prefix = make_cache(model, write=("exact", "int4"), fetch=("exact", "int4"), prior_bandwidth_bits=1e3)
    generate(model, [PROMPT], config, prefix=prefix)
    prefix.flush()
    assert "int4" in generate(model, [PROMPT], config, prefix=prefix).stats.prefix_fetches[0].resolutions
    output = generate_lossless(model, [PROMPT], config, LosslessConfig(create_compressor("snapkv"), 4), prefix=prefix)
    assert output.requests[0].token_ids == expected
    assert output.stats.prefix_fetches[0].resolutions == {"exact": 4}


def test_code_lossless_resolutions_restore_quantized_kv(model: LoadedModel) -> None:
    keys = torch.randn(3, 2, CHUNK, 8)
    values = torch.randn(3, 2, CHUNK, 8)
    for name in ("int8", "int4"):
        restored_keys, _ = decode_chunk(RESOLUTIONS[name], encode_chunk(RESOLUTIONS[name], keys, values))
        assert restored_keys.shape == keys.shape and not torch.equal(restored_keys, keys)
        assert (restored_keys - keys).abs().max() < (keys.max() - keys.min()) / 2 ** (int(name[3:]) - 1)
    exact_keys, exact_values = decode_chunk(RESOLUTIONS["exact"], encode_chunk(RESOLUTIONS["exact"], keys, values))
    assert torch.equal(exact_keys, keys) and torch.equal(exact_values, values)


# ----- faults: each one ends the fetch early, the rest is recomputed, output is identical, one log line


class FaultyStore(KVStore):
    """A memory store whose reads fail after `healthy_reads` reads (None: never)."""

    def __init__(self, inner: KVStore, healthy_reads: int | None = None, error: Exception | None = None) -> None:
        self.inner = inner
        self.healthy_reads = healthy_reads
        self.error = error or StoreUnavailableError("store went away")
        self.reads = 0

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        self.reads += 1
        if self.healthy_reads is not None and self.reads > self.healthy_reads:
            raise self.error
        return self.inner.get(key, max_bytes)

    def nbytes(self, key: str) -> int | None:
        return self.inner.nbytes(key)

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def keys(self, prefix: str = "") -> list[str]:
        return self.inner.keys(prefix)


def filled_store(model: LoadedModel) -> KVStore:
    store = create_store("memory://")
    prefix = make_cache(model, store)
    restored(model, PROMPT, prefix)
    prefix.flush()
    return store


def check_fallback(model: LoadedModel, prefix: PrefixCache, caplog: pytest.LogCaptureFixture, reused: int) -> None:
    expected_keys, expected_logits = reference(model, PROMPT)
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        keys, logits, got = restored(model, PROMPT, prefix)
    assert got == reused
    assert torch.equal(logits, expected_logits) and all(
        torch.equal(a, b) for a, b in zip(keys, expected_keys, strict=True)
    )
    warnings = [record for record in caplog.records if record.name == "kvlab.store"]
    assert len(warnings) == 1, [record.getMessage() for record in warnings]


def test_missing_chunk_is_recomputed(model: LoadedModel, caplog: pytest.LogCaptureFixture) -> None:
    store = filled_store(model)
    prefix = make_cache(model, store)
    store.delete(prefix.keys(PROMPT, "exact")[2])
    # A chunk absent at lookup simply ends the stored prefix: no fault, no log.
    _, logits, reused = restored(model, PROMPT, prefix)
    assert reused == 2 * CHUNK and torch.equal(logits, reference(model, PROMPT)[1])


def test_chunk_deleted_between_lookup_and_read_is_recomputed(
    model: LoadedModel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = filled_store(model)
    prefix = make_cache(model, store)
    third = prefix.keys(PROMPT, "exact")[2]

    class Vanishing(FaultyStore):
        def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
            return None if key == third else self.inner.get(key, max_bytes)

    prefix.store = Vanishing(store)
    check_fallback(model, prefix, caplog, reused=2 * CHUNK)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupted_chunk_is_recomputed(model: LoadedModel, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    store = filled_store(model)
    prefix = make_cache(model, store)
    key = prefix.keys(PROMPT, "exact")[1]
    data = bytearray(store.get(key) or b"")
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) - 7]
    else:
        data = bytearray(b"not a chunk at all")
    store.put(key, bytes(data))
    check_fallback(model, prefix, caplog, reused=CHUNK)


def test_a_corrupted_chunk_is_named_in_the_warning_and_rewritten(
    model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    store = filled_store(model)
    prefix = make_cache(model, store)
    key = prefix.keys(PROMPT, "exact")[1]
    good = store.get(key)
    store.put(key, b"not a chunk at all")
    check_fallback(model, prefix, caplog, reused=CHUNK)
    assert key in caplog.records[-1].getMessage() and "rewritten" in caplog.records[-1].getMessage()
    prefix.flush()
    assert store.get(key) == good  # the recomputed chunk replaced the broken value (same bits)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        _, logits, reused = restored(model, PROMPT, make_cache(model, store))
    assert reused == 4 * CHUNK and not caplog.records
    assert torch.equal(logits, reference(model, PROMPT)[1])


def test_store_failing_mid_fetch_is_recomputed(model: LoadedModel, caplog: pytest.LogCaptureFixture) -> None:
    prefix = make_cache(model, FaultyStore(filled_store(model), healthy_reads=3))
    check_fallback(model, prefix, caplog, reused=3 * CHUNK)


def test_unreachable_store_is_skipped_after_one_log(model: LoadedModel, caplog: pytest.LogCaptureFixture) -> None:
    prefix = make_cache(model, "redis://127.0.0.1:9/0?timeout=0.2")
    check_fallback(model, prefix, caplog, reused=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvlab.store"):
        restored(model, PROMPT, prefix)  # within retry_after_s: not even tried, nothing logged
    assert not [record for record in caplog.records if record.name == "kvlab.store"]


def test_saving_to_an_unreachable_store_does_not_affect_generation(model: LoadedModel) -> None:
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    prefix = make_cache(model, FaultyStore(create_store("memory://"), healthy_reads=0))
    prefix.store.put = lambda key, data: (_ for _ in ()).throw(StoreUnavailableError("down"))  # type: ignore[method-assign]
    output = generate(model, [PROMPT], config, prefix=prefix)
    prefix.flush()
    assert output.requests[0].token_ids == generate(model, [PROMPT], config).requests[0].token_ids


# ----- a real redis-server


def test_prefix_reuse_through_redis_is_identical(model: LoadedModel, redis_url: str) -> None:
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    expected = generate(model, [PROMPT], config).requests[0].token_ids
    writer = make_cache(model, redis_url, write=("exact", "int8", "int4"))
    generate(model, [PROMPT], config, prefix=writer)
    writer.close()
    reader = make_cache(model, redis_url, write=("exact", "int8", "int4"))
    output = generate(model, [PROMPT], config, prefix=reader)
    assert output.requests[0].token_ids == expected
    assert output.stats.prefix_reused_tokens == 4 * CHUNK
    assert output.stats.prefix_fetches[0].resolutions == {"exact": 4}


def test_redis_killed_mid_fetch_is_recomputed(
    model: LoadedModel, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = create_store(redis_server.url + "?timeout=0.5")
    prefix = make_cache(model, store)
    restored(model, PROMPT, prefix)
    prefix.flush()

    class KillAfterTwoReads(FaultyStore):
        def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
            self.reads += 1
            if self.reads == 3:
                redis_server.stop()
            return self.inner.get(key, max_bytes)

    prefix.store = KillAfterTwoReads(store)
    check_fallback(model, prefix, caplog, reused=2 * CHUNK)


# ----- remote-prefix lossless mode


@pytest.mark.parametrize(
    ("drafter", "window", "low_chunks"),
    [("snapkv", None, 4), ("streamingllm", 2, 2), ("kivi", 1, 1), ("snapkv", 3, 3)],
)
def test_drafting_from_a_low_bit_prefix_is_identical(
    model: LoadedModel, drafter: str, window: int | None, low_chunks: int
) -> None:
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    prompts = [PROMPT, PROMPT[:40] + OTHER_SUFFIX, OTHER_SUFFIX * 3]  # the last one is never stored
    expected = [r.token_ids for r in generate(model, prompts, config).requests]
    prefix = make_cache(model, write=("exact", "int4"))
    generate(model, prompts[:2], config, prefix=prefix)
    prefix.flush()
    spec = LosslessConfig(
        create_compressor(drafter), num_draft_tokens=4, prefix_draft="int4", prefix_draft_chunks=window
    )
    output = generate_lossless(model, prompts, config, spec, prefix=prefix)
    assert [r.token_ids for r in output.requests] == expected
    assert output.stats.prefix_reused_tokens == 4 * CHUNK + 2 * CHUNK
    # Low-bit fetches happen at admission, exact ones land later: the first prompt's are the first of each.
    low = output.stats.prefix_fetches[0]
    exact = next(fetch for fetch in output.stats.prefix_fetches if "exact" in fetch.resolutions)
    # The first chunk and the last (window - 1) ones: a gap in the middle when the window is short.
    assert low.resolutions == {"int4": low_chunks} and exact.resolutions == {"exact": 4}


def test_drafting_from_a_low_bit_prefix_whose_exact_copy_is_gone_is_identical(model: LoadedModel) -> None:
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    expected = generate(model, [PROMPT], config).requests[0].token_ids
    prefix = make_cache(model, write=("exact", "int4"))
    generate(model, [PROMPT], config, prefix=prefix)
    prefix.flush()
    for key in prefix.keys(PROMPT, "exact"):
        prefix.store.delete(key)
    spec = LosslessConfig(create_compressor("snapkv"), num_draft_tokens=4, prefix_draft="int4")
    output = generate_lossless(model, [PROMPT], config, spec, prefix=prefix)
    assert output.requests[0].token_ids == expected and output.stats.prefix_reused_tokens == 0


def test_prefix_draft_must_be_low_bit_and_needs_a_store(model: LoadedModel) -> None:
    from kvlab.errors import ConfigError

    with pytest.raises(ConfigError, match="use one of int8, int4, int4-video"):
        LosslessConfig(create_compressor("snapkv"), prefix_draft="exact")
    spec = LosslessConfig(create_compressor("snapkv"), prefix_draft="int4")
    with pytest.raises(ConfigError, match="prefix store"):
        generate_lossless(model, [PROMPT], GenerationConfig(max_new_tokens=2), spec)


def test_a_prefix_restored_with_gaps_keeps_the_rest_causal(model: LoadedModel) -> None:
    """Chunks 0 and 3 only: the tokens after them must still not see their own future."""
    from kvlab.cache import ForwardStep, KVCache, run_step

    prefix = make_cache(model)
    restored(model, PROMPT, prefix)
    prefix.flush()

    def suffix_logits(suffix: list[int]) -> torch.Tensor:
        fetched = prefix.fetch(PROMPT, chunks=[0, 3])
        assert fetched.starts == [0, 3 * CHUNK] and fetched.end == 4 * CHUNK
        cache = KVCache.allocate(model.architecture, 1, 128, model.dtype, model.device)
        fetched.restore_into(cache, model.device)
        assert cache.seq_lengths == [4 * CHUNK]
        stored = torch.arange(2 * CHUNK, 2 * CHUNK + len(suffix))[None]
        step = ForwardStep(cache, cache.next_positions(len(suffix), model.device), mask_positions=stored)
        return run_step(model.model, step, torch.tensor([suffix]))

    first = suffix_logits([5, 9, 4, 33, 17])
    changed_last = suffix_logits([5, 9, 4, 33, 60])
    assert torch.equal(first[:, :-1], changed_last[:, :-1])
    assert not torch.equal(first[:, -1], changed_last[:, -1])


@pytest.mark.parametrize("window", [None, 2])
def test_after_the_remote_start_both_caches_hold_the_same_sequence(model: LoadedModel, window: int | None) -> None:
    from kvlab.cache import KVCache
    from kvlab.engine import Engine, Request, SinglePrefixSource

    prefix = make_cache(model, write=("exact", "int4"))
    generate(model, [PROMPT], GenerationConfig(max_new_tokens=1, prefill_chunk_tokens=CHUNK), prefix=prefix)
    prefix.flush()
    # A slow link, so that several tokens are drafted while the exact prefix transfers.
    prefix.store = ThrottledStore(prefix.store, bits_per_s=1e6, burst_bytes=1)
    lossless = LosslessConfig(
        create_compressor("streamingllm", compression_ratio=0.0), 6, prefix_draft="int4", prefix_draft_chunks=window
    )
    config = GenerationConfig(max_new_tokens=8, prefill_chunk_tokens=CHUNK)
    engine = Engine(model, prefixes=SinglePrefixSource(prefix))
    request_id = engine.add_request(Request(PROMPT, config, lossless=lossless))
    engine.step()
    assert engine.reused_tokens(request_id) == 0, "the remote start restores no prefix through a prefill"
    while engine.lossless_stats.rounds == 0:
        engine.step()
    state = engine.sequence(request_id).lossless
    assert state is not None and isinstance(state.full, KVCache)
    accepted = len(engine.output(request_id).token_ids) - 1
    assert engine.lossless_stats.num_draft_tokens > 1
    # Both hold the prompt and the accepted drafts: everything before the next token.
    assert state.full.seq_lengths == state.draft.seq_lengths == [len(PROMPT) + accepted]
    stored_low = (4 if window is None else window) * CHUNK
    rest = len(PROMPT) - 4 * CHUNK
    for layer in state.draft.layers:  # keeps everything (ratio 0): window + rest of prompt + accepted drafts
        assert layer.lengths == [stored_low + rest + accepted]  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", ["snapkv", "kivi"])
def test_lossy_decoding_with_a_prefix_store_restores_then_compresses(model: LoadedModel, method: str) -> None:
    """The store holds full KV; a compressed cache takes the restored prefix and compresses the whole
    prompt after its last piece, exactly as when every chunk is computed."""
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    compressor = create_compressor(method)
    expected = generate(model, [PROMPT], config, compressor=compressor)
    prefix = make_cache(model)
    generate(model, [PROMPT], config, compressor=compressor, prefix=prefix)
    prefix.flush()
    output = generate(model, [PROMPT], config, compressor=compressor, prefix=prefix)
    assert output.stats.prefix_reused_tokens == 4 * CHUNK
    assert output.requests[0].token_ids == expected.requests[0].token_ids
    assert output.stats.kv_bytes == expected.stats.kv_bytes


def test_a_failure_on_the_exact_prefix_thread_reaches_the_caller(model: LoadedModel) -> None:
    """The exact prefix transfers on its own thread while the low-bit one drafts; what fails there is
    raised to the caller as it was, never lost (a missing result used to surface as a KeyError)."""
    prefix = make_cache(model, write=("exact", "int4"))
    generate(model, [PROMPT], GenerationConfig(max_new_tokens=1, prefill_chunk_tokens=CHUNK), prefix=prefix)
    prefix.flush()
    fetch = prefix.fetch

    def failing_exact_fetch(tokens, resolutions=None, chunks=None):  # type: ignore[no-untyped-def]
        if resolutions is not None and "int4" not in resolutions:
            raise RuntimeError("exact transfer failed")
        return fetch(tokens, resolutions, chunks)

    prefix.fetch = failing_exact_fetch  # type: ignore[method-assign]
    lossless = LosslessConfig(create_compressor("snapkv"), 4, prefix_draft="int4")
    config = GenerationConfig(max_new_tokens=6, prefill_chunk_tokens=CHUNK)
    with pytest.raises(RuntimeError, match="exact transfer failed"):
        generate_lossless(model, [PROMPT], config, lossless, prefix=prefix)


def test_a_decoder_store_writes_what_it_fetches_and_the_low_bit_drafting_resolution() -> None:
    assert PrefixConfig.for_decoding().write == ("exact",)
    config = PrefixConfig.for_decoding(("exact",), "int4", chunk_tokens=CHUNK)
    assert (config.write, config.fetch, config.chunk_tokens) == (("exact", "int4"), ("exact",), CHUNK)
    assert PrefixConfig.for_decoding(("exact", "int4"), "int4").write == ("exact", "int4")
