"""The disk full-KV tier under a co-writer: a tier file changed while a decode runs is a TierError, never
different tokens (the reservation error's amounts are tested in tests/unit/cache/test_tiers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvlab.cache import KVCache, forward
from kvlab.cache.tiers import TierError, TierLoader, TierSpec, move_to_tier
from kvlab.models import LoadedModel
from tests.helpers import tiny_llama

PROMPT_TOKENS, CAPACITY = 60, 80


@pytest.fixture(autouse=True)
def _tier_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLAB_TIER_DIR", str(tmp_path / "tiers"))
    return tmp_path / "tiers"


def prefilled_cache(loaded: LoadedModel) -> KVCache:
    cache = KVCache.allocate(loaded.architecture, 1, CAPACITY, loaded.dtype, "cpu")
    forward(loaded.model, cache, torch.randint(3, 96, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)))
    return cache


def tiered_cache(loaded: LoadedModel, tier_dir: Path) -> tuple[KVCache, list[Path]]:
    tiered = move_to_tier(prefilled_cache(loaded), TierLoader(TierSpec.parse("disk")), CAPACITY)
    return tiered, sorted(tier_dir.rglob("*.kv"))


def test_an_untouched_disk_tier_decodes_as_the_cache_in_memory_does(_tier_dir: Path) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    tiered, _ = tiered_cache(loaded, _tier_dir)
    in_memory = prefilled_cache(loaded)
    tokens = torch.randint(3, 96, (3, 1, 1), generator=torch.Generator().manual_seed(1))
    for step, token in enumerate(tokens):
        expected = forward(loaded.model, in_memory, token)
        actual = forward(loaded.model, tiered, token)
        assert torch.equal(actual.view(torch.int32), expected.view(torch.int32)), (
            f"decode step {step}: logits from the disk tier differ from the in-memory cache's")


@pytest.mark.parametrize("change", ["overwritten", "truncated-and-re-extended"])
def test_a_tier_file_changed_under_the_decode_is_an_error(_tier_dir: Path, change: str) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    tiered, files = tiered_cache(loaded, _tier_dir)
    forward(loaded.model, tiered, torch.randint(3, 96, (1, 1)))  # the file is read and checked once
    target = files[1]
    if change == "overwritten":
        # One 2-byte word of token 17 of head 0's keys, written as a co-writer would: in place, same size.
        handle = os.open(target, os.O_RDWR)
        try:
            offset = 17 * loaded.architecture.head_dim * 4
            word = os.pread(handle, 2, offset)
            os.pwrite(handle, bytes([word[0] ^ 1, word[1]]), offset)
        finally:
            os.close(handle)
    else:
        size = target.stat().st_size
        os.truncate(target, 0)
        os.truncate(target, size)  # every byte is back, as zeros
    with pytest.raises(TierError, match=r"changed under the decode \(the keys of head 0, slot 0, .* token (17|0) on\)"):
        forward(loaded.model, tiered, torch.randint(3, 96, (1, 1)))
