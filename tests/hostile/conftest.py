"""A victim model, prompt and store for the hostile corpus: chunk 0 genuine, chunk 1 planted by an attacker."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvlab.engine import generate
from kvlab.generation import GenerationConfig
from kvlab.models import LoadedModel
from kvlab.store import ChunkSealer, KVStore, create_store
from kvlab.store.prefix import PrefixCache, PrefixConfig
from kvlab.store.resolution import RESOLUTIONS, decode_chunk
from tests.helpers import tiny_llama
from tests.hostile.corpus import FOREIGN, MALFORMED, hostile_chunks

CHUNK = 16
VICTIM = [(7 * i + 3) % 90 + 3 for i in range(40)]  # chunks 0 and 1 are reusable
OTHER = [(11 * i + 5) % 90 + 3 for i in range(40)]
SECRET = b"a store secret of 32 bytes, ok!!"
CONFIG = GenerationConfig(max_new_tokens=8, ignore_eos=True, prefill_chunk_tokens=CHUNK)
# Every stored value of the corpus, plus the swapped chunk (another prompt's authentic value).
CASES = (*MALFORMED, *FOREIGN, "truncated_value", "swapped_chunk")


@dataclasses.dataclass
class Planted:
    """A store whose chunk 1 of VICTIM holds a hostile value, and what recomputing gives."""

    store: KVStore
    sealer: ChunkSealer
    key: str
    expected: list[int]


@pytest.fixture(scope="session")
def victim_model() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=3)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The victim model saved as a local model directory, for a CLI or a server to load by path."""
    directory = tmp_path_factory.mktemp("tiny-model")
    loaded = tiny_llama(num_kv_heads=2, seed=3)
    loaded.model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)
    return directory


def prefix_config() -> PrefixConfig:
    # A tiny model recomputes faster than anything decodes: pin fetching on, as an attacker would hope.
    return PrefixConfig(chunk_tokens=CHUNK, allow_recompute=False)


def plant(model: LoadedModel, case: str, secret: bytes | None, store_url: str = "memory://") -> Planted:
    """Fill a store with VICTIM's and OTHER's chunks, then replace VICTIM's chunk 1 by `case`.

    With a secret, the attacker holds it too (an insider): the hostile bytes are sealed, so the checks
    behind authentication are what must stop them. The swapped chunk is an authentic value moved.
    """
    store = create_store(store_url)
    sealer = ChunkSealer(secret)
    writer = PrefixCache.for_model(model, store, prefix_config(), sealer)
    expected = generate(model, [VICTIM], CONFIG).requests[0].token_ids
    generate(model, [VICTIM], CONFIG, prefix=writer)
    generate(model, [OTHER], CONFIG, prefix=writer)
    writer.close()
    key = writer.keys(VICTIM, "exact")[1]
    if case == "swapped_chunk":
        value = store.get(writer.keys(OTHER, "exact")[1])
        assert value is not None
    else:
        genuine = store.get(key)
        assert genuine is not None
        keys, values = decode_chunk(RESOLUTIONS["exact"], sealer.open(key, genuine))
        value = sealer.seal(key, hostile_chunks(keys.to(torch.float32), values.to(torch.float32))[case])
    store.put(key, value)
    return Planted(store, sealer, key, expected)
