"""Full-KV tiers: every tier gives the memory tier's tokens, reads cost what they move, faults are errors."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from kvlab.bandwidth import TokenBucket
from kvlab.cache import KVCache, forward
from kvlab.cache.tiers import (
    EMULATED_BURST_BYTES,
    TieredKVLayer,
    TierError,
    TierLoader,
    TierSpec,
    move_to_tier,
    request_loads,
)
from kvlab.compress import create_compressor
from kvlab.engine import generate, generate_lossless
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessConfig
from tests.helpers import FakeClock, tiny_llama

TIERS = ["host", "disk", "emulated:5"]


def _prompts(*lengths: int) -> list[list[int]]:
    return [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


@pytest.fixture(autouse=True)
def _tier_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLAB_TIER_DIR", str(tmp_path / "tiers"))
    return tmp_path / "tiers"


def test_tier_names_parse_and_bad_ones_are_refused() -> None:
    assert TierSpec.parse("emulated:2").gigabytes_per_s == 2.0
    assert TierSpec.parse("emulated:0.5").name == "emulated:0.5"
    assert TierSpec.parse("disk").kind == "disk"
    for bad in ("tape", "emulated", "emulated:-1", "emulated:x"):
        with pytest.raises(ConfigError, match="tier"):
            TierSpec.parse(bad)


@pytest.mark.parametrize("tier", TIERS)
def test_plain_decoding_on_a_tier_gives_the_memory_tokens_and_reads_the_tier_every_step(tier: str) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompts = _prompts(50, 31)
    expected = generate(loaded, prompts, GenerationConfig(max_new_tokens=12, ignore_eos=True))
    output = generate(loaded, prompts, GenerationConfig(max_new_tokens=12, ignore_eos=True, full_kv_tier=tier))
    assert [r.token_ids for r in output.requests] == [r.token_ids for r in expected.requests]
    layers = loaded.architecture.num_layers
    # 11 decode steps after the prefill's token, each reading every layer of both rows.
    assert output.stats.tier == tier
    assert output.stats.tier_bytes_read > 0
    per_token_bytes = 2 * 2 * 16 * 4  # keys + values, 2 KV heads, head_dim 16, fp32
    lower_bound = 11 * layers * (50 + 31) * per_token_bytes
    assert output.stats.tier_bytes_read >= lower_bound


@pytest.mark.parametrize("tier", ["memory", *TIERS])
@pytest.mark.parametrize("schedule", ["staggered", "synchronous"])
@pytest.mark.parametrize("drafter", ["snapkv", "kivi"])
def test_ragged_lossless_batches_on_every_tier_decode_each_prompt_as_alone(
    tier: str,
    schedule: str,
    drafter: str,
) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompts = _prompts(70, 23, 45)
    config = GenerationConfig(max_new_tokens=24, full_kv_tier=tier)
    settings = {"snapkv": {"compression_ratio": 0.7}, "kivi": {"bits": 2, "group_size": 8, "residual_length": 8}}
    lossless = LosslessConfig(create_compressor(drafter, **settings[drafter]), "auto", schedule=schedule)  # type: ignore[arg-type]
    output = generate_lossless(loaded, prompts, config, lossless)
    for index, prompt in enumerate(prompts):
        alone = generate(loaded, [prompt], GenerationConfig(max_new_tokens=24))
        assert output.requests[index].token_ids == alone.requests[0].token_ids, f"{tier} {schedule} prompt {index}"
    if tier != "memory":
        assert output.stats.tier_bytes_read > 0


def test_rows_keep_their_own_draft_lengths() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    prompts = _prompts(60, 40)
    output = generate_lossless(
        loaded, prompts, GenerationConfig(max_new_tokens=30),
        LosslessConfig(create_compressor("streamingllm", budget=8)),
    )
    # Rounds are per sequence: their count differs from a lock-stepped batch's multiple of the batch size.
    assert output.lossless.rounds == len(output.lossless.num_draft_tokens_per_round)
    assert output.lossless.num_draft_tokens == sum(output.lossless.num_draft_tokens_per_round)


def test_an_emulated_tier_charges_every_byte_it_reads_at_its_bandwidth() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    cache = KVCache.allocate(loaded.architecture, 1, 400, loaded.dtype, "cpu")
    forward(loaded.model, cache, torch.randint(3, 96, (1, 300)))
    loader = TierLoader(TierSpec.parse("emulated:0.001"))  # 1 MB/s
    assert loader.bucket is not None
    clock = FakeClock()
    loader.bucket = TokenBucket(loader.bucket.rate, loader.bucket.burst, clock=clock, sleep=clock.sleep)
    tiered = move_to_tier(cache, loader, 400)
    # What the planner prices the link with (`load_bytes`) is what the loads move, not `nbytes`'s fp16.
    priced = sum(layer.load_bytes(0) for layer in tiered.layers)  # type: ignore[attr-defined]
    forward(loaded.model, tiered, torch.randint(3, 96, (1, 1)))
    moved = loader.stats.bytes_read
    assert moved == loaded.architecture.num_layers * 2 * 2 * 300 * 16 * 4 == priced
    # The burst is free, every other byte waits its turn at 1 MB/s: the link's clock moved exactly that long.
    assert clock.now == pytest.approx((moved - EMULATED_BURST_BYTES) / 1e6, rel=1e-9), clock.slept


def test_a_truncated_disk_tier_file_is_an_error_not_wrong_tokens(_tier_dir: Path) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    cache = KVCache.allocate(loaded.architecture, 1, 80, loaded.dtype, "cpu")
    forward(loaded.model, cache, torch.randint(3, 96, (1, 60)))
    tiered = move_to_tier(cache, TierLoader(TierSpec.parse("disk")), 80)
    files = sorted(_tier_dir.rglob("*.kv"))
    assert len(files) == loaded.architecture.num_layers
    assert all(os.stat(path).st_mode & 0o777 == 0o600 for path in files)
    os.truncate(files[0], 100)
    with pytest.raises(TierError, match="truncated"):
        forward(loaded.model, tiered, torch.randint(3, 96, (1, 1)))


def test_disk_tier_files_are_removed_with_the_cache_and_stale_directories_at_start(_tier_dir: Path) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    cache = KVCache.allocate(loaded.architecture, 1, 40, loaded.dtype, "cpu")
    forward(loaded.model, cache, torch.randint(3, 96, (1, 20)))
    _tier_dir.mkdir(parents=True)
    stale = _tier_dir / "kvlab-tier-999999999-abc"  # no such process
    stale.mkdir()
    (stale / "layer-000-0.kv").write_bytes(b"prompt KV")
    loader = TierLoader(TierSpec.parse("disk"))
    assert not stale.exists()
    tiered = move_to_tier(cache, loader, 40)
    assert all(isinstance(layer, TieredKVLayer) for layer in tiered.layers)
    assert list(_tier_dir.rglob("*.kv"))
    del tiered, loader
    gc.collect()
    assert not list(_tier_dir.rglob("*.kv"))


def test_a_disk_tier_that_cannot_be_reserved_fails_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    cache = KVCache.allocate(loaded.architecture, 1, 40, loaded.dtype, "cpu")
    forward(loaded.model, cache, torch.randint(3, 96, (1, 20)))

    def full_disk(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full_disk)
    with pytest.raises(TierError, match="No space left on device") as raised:
        move_to_tier(cache, TierLoader(TierSpec.parse("disk")), 40)
    # 2 heads x (keys, values) x one 4096-byte aligned region of 40 tokens: 16 KiB, not "0.00 GiB".
    assert "cannot reserve 16.00 KiB" in str(raised.value) and "free there" in str(raised.value), raised.value
    assert "0.00 GiB" not in str(raised.value)


def test_loads_requested_ahead_are_used_once() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    cache = KVCache.allocate(loaded.architecture, 1, 80, loaded.dtype, "cpu")
    forward(loaded.model, cache, torch.randint(3, 96, (1, 30)))
    loader = TierLoader(TierSpec.parse("host"))
    tiered = move_to_tier(cache, loader, 80)
    request_loads(tiered)
    request_loads(tiered)  # a second request while one is queued loads nothing more
    forward(loaded.model, tiered, torch.randint(3, 96, (1, 1)))
    assert loader.stats.loads == loaded.architecture.num_layers
    forward(loaded.model, tiered, torch.randint(3, 96, (1, 1)))  # the next forward loads again
    assert loader.stats.loads == 2 * loaded.architecture.num_layers


def test_a_loaders_link_rate_is_declared_for_an_emulated_tier_and_measured_otherwise() -> None:
    assert TierLoader(TierSpec.parse("emulated:2")).bytes_per_s() == 2e9
    assert TierLoader(TierSpec.parse("memory")).bytes_per_s() is None
    host = TierLoader(TierSpec.parse("host"))
    assert host.bytes_per_s() is None  # nothing loaded yet
    host.record(1000, 0.5)
    assert host.bytes_per_s() == 2000.0
