"""Video-coded code resolutions in the store: planned per chunk, restored token by token, drafted from."""

from __future__ import annotations

import pytest
import torch

from kvlab.compress import create_compressor
from kvlab.engine import generate, generate_lossless
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel
from kvlab.store.auth import ChunkSealer
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.prefix.fetcher import Estimates, PrefixFetcher
from kvlab.store.prefix.planner import RECOMPUTE
from kvlab.store.resolution import (
    RESOLUTIONS,
    ChunkGeometry,
    decode_chunk,
    decode_chunk_by_token,
    encode_chunk,
)
from tests.helpers import tiny_llama

CHUNK = 16
PROMPT = [(7 * i + 3) % 90 + 3 for i in range(75)]  # 4 complete chunks + 11 tokens
VIDEO = tuple(name for name, resolution in RESOLUTIONS.items() if resolution.codec == "video_codes")


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=3)


def make_cache(model: LoadedModel, **overrides: object) -> PrefixCache:
    config = PrefixConfig(chunk_tokens=CHUNK, allow_recompute=False, **overrides)  # type: ignore[arg-type]
    return PrefixCache.for_model(model, "memory://", config)


def test_video_resolutions_are_code_lossless_and_rank_by_bits() -> None:
    assert set(VIDEO) == {"int4-video", "int3-video", "int2-video"}
    assert all(RESOLUTIONS[name].lossless == "codes" and RESOLUTIONS[name].decodes_by_token for name in VIDEO)
    by_quality = sorted(VIDEO, key=lambda name: RESOLUTIONS[name].quality)
    bits = [RESOLUTIONS[name].nominal_bits_per_value for name in by_quality]
    assert bits == sorted(bits), "lower quality must mean fewer bits"


@pytest.mark.parametrize("name", VIDEO)
def test_token_by_token_restore_equals_the_chunk_decode(name: str) -> None:
    keys, values = torch.randn(3, 2, CHUNK, 16), torch.randn(3, 2, CHUNK, 16)
    data = encode_chunk(RESOLUTIONS[name], keys, values)
    whole_keys, whole_values = decode_chunk(RESOLUTIONS[name], data)
    token_keys, token_values, restore = decode_chunk_by_token(RESOLUTIONS[name], data)
    assert torch.equal(token_keys.view(torch.int32), whole_keys.view(torch.int32)), f"{name} keys"
    assert torch.equal(token_values.view(torch.int32), whole_values.view(torch.int32)), f"{name} values"
    assert restore.peak_buffer_bytes > 0 and 0.0 <= restore.restore_overlap <= 1.0


def test_a_slow_link_plans_the_smallest_video_resolution_and_a_fast_one_the_exact_copy() -> None:
    names = ["exact", "int8", "int4", *VIDEO]
    config = PrefixConfig(chunk_tokens=256, write=(), fetch=tuple(names), allow_recompute=False)
    fetcher = PrefixFetcher(config, Estimates(config), ChunkSealer(None), ChunkGeometry(256, 1 << 30), 92160)
    fetcher.estimates.bandwidth = 1e6  # 8 Mbit/s: bytes dominate
    assert fetcher.plan([names] * 3, allow_recompute=False) == ["int2-video"] * 3
    fetcher.estimates.bandwidth = 1e12  # decoding dominates: the fast bit-exact decoder wins
    assert set(fetcher.plan([names] * 3, allow_recompute=False)) == {"exact"}


def test_measured_bits_per_value_replace_the_prior() -> None:
    config = PrefixConfig(chunk_tokens=CHUNK)
    estimates = Estimates(config)
    prior = estimates.bits_per_value["int2-video"]
    for _ in range(20):
        estimates.observe_decode("int2-video", num_values=1000, stored_bytes=500, seconds=0.01)
    assert prior != 4.0 and estimates.bits_per_value["int2-video"] == pytest.approx(4.0, rel=1e-3)
    assert RECOMPUTE not in estimates.bits_per_value


def test_a_video_resolution_fetch_restores_token_by_token(model: LoadedModel) -> None:
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    prefix = make_cache(model, write=("int4-video",), fetch=("int4-video",))
    generate(model, [PROMPT], config, prefix=prefix)
    prefix.flush()
    stats = generate(model, [PROMPT], config, prefix=prefix).stats.prefix_fetches[0]
    assert stats.resolutions == {"int4-video": 4} and stats.token_restored_chunks == 4
    assert stats.peak_decode_buffer_bytes > 0


@pytest.mark.parametrize("name", ["int2-video", "int4-video"])
def test_drafting_from_a_video_coded_prefix_is_identical(model: LoadedModel, name: str) -> None:
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    expected = generate(model, [PROMPT], config).requests[0].token_ids
    prefix = make_cache(model, write=("exact", name))
    generate(model, [PROMPT], config, prefix=prefix)
    prefix.flush()
    lossless = LosslessConfig(create_compressor("snapkv"), num_draft_tokens=4, prefix_draft=name)
    output = generate_lossless(model, [PROMPT], config, lossless, prefix=prefix)
    assert output.requests[0].token_ids == expected
    assert output.stats.prefix_fetches[0].resolutions == {name: 4}, "the drafter started from the video copy"
    assert any(fetch.resolutions == {"exact": 4} for fetch in output.stats.prefix_fetches), "verified on exact KV"
