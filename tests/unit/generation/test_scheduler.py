"""The fetch-aware scheduler: requests without a fetch do not wait behind a slow one."""

from __future__ import annotations

import pytest

from kvlab.generation import generate
from kvlab.generation.config import GenerationConfig
from kvlab.generation.scheduler import FetchAwareScheduler, Request
from kvlab.models import LoadedModel
from kvlab.store import create_store
from kvlab.store.link import ThrottledStore
from kvlab.store.prefix import PrefixCache, PrefixConfig
from tests.helpers import tiny_llama

CHUNK = 16
SHARED = [(5 * i + 7) % 90 + 3 for i in range(80)]
CONFIG = GenerationConfig(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=5)


def slow_prefix(model: LoadedModel) -> PrefixCache:
    """A store holding SHARED's prefix behind a link slow enough that fetching it takes about 2 s."""
    store = create_store("memory://")
    config = PrefixConfig(chunk_tokens=CHUNK, allow_recompute=False)
    writer = PrefixCache.for_model(model, store, config)
    generate(model, [SHARED], CONFIG, prefix=writer)
    writer.close()
    written = store.keys()
    stored = sum(len(store.get(key) or b"") for key in written)
    link = ThrottledStore(store, bits_per_s=stored * 8 / 2.0, burst_bytes=1)
    return PrefixCache.for_model(model, link, config)


@pytest.mark.parametrize("fetch_aware", [True, False])
def test_requests_without_a_fetch_overtake_a_slow_fetch_only_when_fetch_aware(model: LoadedModel, fetch_aware: bool) -> None:
    requests = [Request(SHARED + [9, 10], CONFIG, 0.0)] + [Request([11 + i, 12, 13, 14], CONFIG, 0.05) for i in range(3)]
    completions = FetchAwareScheduler(model, slow_prefix(model), fetch_aware=fetch_aware).run(requests)
    reuse, others = completions[0], completions[1:]
    assert reuse.output.stats.prefix_reused_tokens == 5 * CHUNK
    if fetch_aware:
        assert reuse.fetch_done_s is not None
        assert all(other.finished_s < reuse.fetch_done_s for other in others)
    else:
        assert all(other.started_s >= reuse.finished_s for other in others)
    # Scheduling never changes what is generated.
    for request, completion in zip(requests, completions):
        assert completion.output.requests[0].token_ids == generate(model, [request.prompt], CONFIG).requests[0].token_ids
