"""Gemma 3 270M, the second real model: sliding-window layers on a prompt longer than their window.

The key real-model tests of SmolLM2 on Gemma 3's geometry (1 KV head of 256, a 512-token window on
15 of 18 layers, 262K vocabulary): greedy decoding equals transformers', lossless decoding equals
plain decoding, and a prefix restored from a store equals recomputation. Prompts run past the
window (so sliding layers drop keys) and stay short, to keep CI within its budget.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.compress import Compressor, create_compressor
from kvlab.data import document_token_ids
from kvlab.engine import generate, generate_lossless
from kvlab.generation import GenerationConfig, GenerationStats
from kvlab.generation.prefill import PrefillCaches, PrefixReuse, prefill
from kvlab.lossless import LosslessConfig, LosslessOutput
from kvlab.models import EMBEDDED_MODELS, LoadedModel, load_model
from kvlab.store.prefix import PrefixCache, PrefixConfig
from tests.families import TEST_DEVICE
from tests.helpers import transformers_greedy

pytestmark = pytest.mark.integration

ALIAS = "gemma3-270m"
WINDOW = 512
CHUNK = 256
NEW_TOKENS = 10


def generate_lossless_greedy(
    loaded: LoadedModel, prompts: list[list[int]], config: GenerationConfig, drafter: Compressor
) -> LosslessOutput:
    """Every lossless call of this module goes through here."""
    return generate_lossless(loaded, prompts, config, LosslessConfig(drafter, num_draft_tokens=4))


@pytest.fixture(scope="module")
def gemma() -> LoadedModel:
    if not EMBEDDED_MODELS[ALIAS].installed():
        pytest.fail(f"{ALIAS} is not installed; `make setup` installs it ({EMBEDDED_MODELS[ALIAS].install})")
    return load_model(ALIAS, device=TEST_DEVICE)


@pytest.fixture(scope="module")
def prompt(gemma: LoadedModel) -> list[int]:
    """BOS and 600 document tokens: past the 512-token window of the sliding layers."""
    bos = gemma.tokenizer.bos_token_id
    assert bos is not None
    return [bos, *document_token_ids(gemma.tokenizer, 600)]


def test_the_listing_states_the_loaded_geometry(gemma: LoadedModel) -> None:
    arch = gemma.architecture
    assert arch.model_type == "gemma3_text"
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (18, 4, 1, 256)
    assert arch.sliding_windows.count(WINDOW) == 15 and arch.sliding_windows.count(None) == 3
    assert arch.max_context == EMBEDDED_MODELS[ALIAS].context == 32768


def test_greedy_equals_transformers_past_the_window(gemma: LoadedModel, prompt: list[int]) -> None:
    expected = transformers_greedy(gemma, prompt, max_new_tokens=NEW_TOKENS)
    output = generate(gemma, [prompt], GenerationConfig(max_new_tokens=NEW_TOKENS))
    assert output.requests[0].token_ids == expected


@pytest.fixture(scope="module")
def plain_tokens(gemma: LoadedModel, prompt: list[int]) -> list[int]:
    return generate(gemma, [prompt], GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)).requests[0].token_ids


@pytest.mark.parametrize(("drafter", "params"), [("snapkv", {"compression_ratio": 0.9}), ("kivi", {"bits": 2})])
def test_lossless_output_equals_plain_greedy(
    gemma: LoadedModel, prompt: list[int], plain_tokens: list[int], drafter: str, params: dict[str, object]
) -> None:
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    output = generate_lossless_greedy(gemma, [prompt], config, create_compressor(drafter, **params))
    assert output.requests[0].token_ids == plain_tokens


def test_a_restored_prefix_gives_the_logits_of_recomputation(gemma: LoadedModel, prompt: list[int]) -> None:
    prefix = PrefixCache.for_model(gemma, "memory://", PrefixConfig(CHUNK, allow_recompute=False))
    prefill(gemma, [prompt[:560]], PrefillCaches(600), PrefixReuse(prefix))
    prefix.flush()
    continued = prompt[:540] + prompt[560:]  # shares two chunks, then differs
    stats = GenerationStats()
    restored, _, logits = prefill(
        gemma, [continued], PrefillCaches(len(continued) + 1), PrefixReuse(prefix, stats=stats)
    )
    recomputed, _, expected = prefill(gemma, [continued], PrefillCaches(len(continued) + 1), chunk_tokens=CHUNK)
    assert stats.prefix_reused_tokens == 2 * CHUNK
    assert torch.equal(logits, expected)
    for index, (got, want) in enumerate(zip(restored.layers, recomputed.layers, strict=True)):
        assert torch.equal(got.values[:, :, : len(continued)], want.values[:, :, : len(continued)]), f"layer {index}"
