"""The architecture matrix: every family in `tests.families` through every kvlab capability.

Capabilities: greedy generation equals transformers'; every compressor's identity setting gives
bit-identical logits; lossless greedy decoding equals plain decoding for every drafter; a prefix
restored from a store gives the logits of recomputation; every codec round-trips the family's KV.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvlab.cache import KVCache, forward
from kvlab.codec import create_codec
from kvlab.compress import Compressor, compressors, create_compressor
from kvlab.engine import generate, generate_lossless
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig, GenerationStats
from kvlab.generation.prefill import PrefillCaches, PrefixReuse, prefill
from kvlab.lossless import LosslessConfig, LosslessOutput
from kvlab.models import LoadedModel
from kvlab.store.prefix import PrefixCache, PrefixConfig
from tests.families import FAMILIES, NOT_IN_MATRIX, Family, family_named, family_params
from tests.helpers import assert_identity_compression_is_bit_identical, plain_attention, transformers_greedy
from tests.unit.codec.matrix import CODEC_MATRIX
from tests.unit.compress.test_compressors import IDENTITY, METHOD_MATRIX

CHUNK = 16
PROMPT = [(7 * i + 3) % 90 + 3 for i in range(45)]  # past every sliding window of the matrix
OTHER_PROMPT = [(11 * i + 5) % 90 + 3 for i in range(60)]


def generate_lossless_greedy(
    loaded: LoadedModel, prompts: list[list[int]], config: GenerationConfig, drafter: Compressor
) -> LosslessOutput:
    """Every lossless call of this module goes through here (the package's public entry point)."""
    return generate_lossless(loaded, prompts, config, LosslessConfig(drafter, num_draft_tokens=4))


def test_every_causal_lm_family_is_in_the_matrix_or_has_a_reason() -> None:
    covered = {family.model_type for family in FAMILIES}
    missing = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - covered - set(NOT_IN_MATRIX))
    assert not missing, f"add these model types to FAMILIES or to NOT_IN_MATRIX with a reason: {missing}"
    stale = sorted(set(NOT_IN_MATRIX) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    assert not stale, f"NOT_IN_MATRIX names model types transformers no longer builds: {stale}"
    assert not covered & set(NOT_IN_MATRIX), "a family is both in the matrix and excused from it"


def test_family_names_are_unique() -> None:
    names = [family.name for family in FAMILIES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.unsupported], ids=lambda f: f.name)
def test_an_unsupported_family_is_refused_naming_what_is_missing(family: Family) -> None:
    with pytest.raises(ConfigError, match=family.refusal):
        family.build()


def test_a_layer_kind_the_cache_cannot_compute_is_refused_naming_it() -> None:
    chunked = Family(
        "llama-chunked", "llama", "an attention kind kvlab lacks",
        {"layer_types": ["chunked_attention", "full_attention"] * 2},
    )
    with pytest.raises(ConfigError, match=r"chunked_attention layers; kvlab's cache implements only"):
        chunked.build()


@pytest.mark.parametrize("family", family_params())
def test_greedy_generation_equals_transformers(family: Family) -> None:
    loaded = family.build()
    for prompt in (PROMPT, OTHER_PROMPT[:9]):
        expected = transformers_greedy(loaded, prompt, max_new_tokens=20)
        output = generate(loaded, [prompt], GenerationConfig(max_new_tokens=20))
        assert output.requests[0].token_ids == expected, f"{family.name}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("compressor", sorted(IDENTITY))
@pytest.mark.parametrize("family", family_params())
def test_identity_compression_gives_bit_identical_logits(family: Family, compressor: str) -> None:
    loaded = family.build()
    ids = torch.tensor([OTHER_PROMPT[:48]])
    assert_identity_compression_is_bit_identical(
        loaded, create_compressor(compressor, **IDENTITY[compressor]), ids, f"{family.name} {compressor}"
    )


def test_the_matrix_drafts_with_every_registered_compressor() -> None:
    assert sorted(METHOD_MATRIX) == compressors.names()


@pytest.mark.parametrize("drafter", sorted(METHOD_MATRIX))
@pytest.mark.parametrize("family", family_params())
def test_lossless_greedy_equals_plain_decoding(family: Family, drafter: str) -> None:
    loaded = family.build()
    prompts = [PROMPT, OTHER_PROMPT]
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    expected = [request.token_ids for request in generate(loaded, prompts, config).requests]
    # The hard setting of each method drafts badly enough that verification rejects drafts.
    hard_setting: dict[str, Any] = METHOD_MATRIX[drafter][1]
    output = generate_lossless_greedy(loaded, prompts, config, create_compressor(drafter, **hard_setting))
    for index, request in enumerate(output.requests):
        assert request.token_ids == expected[index], f"{family.name} drafted by {drafter}: prompt {index}"


@pytest.mark.parametrize("family", family_params())
def test_a_restored_prefix_gives_the_logits_of_recomputation(family: Family) -> None:
    loaded = family.build()
    prefix = PrefixCache.for_model(loaded, "memory://", PrefixConfig(chunk_tokens=CHUNK, allow_recompute=False))
    prefill(loaded, [OTHER_PROMPT[:50]], PrefillCaches(54), PrefixReuse(prefix))
    prefix.flush()
    prompt = OTHER_PROMPT[:50] + PROMPT[:7]
    stats = GenerationStats()
    restored, _, logits = prefill(loaded, [prompt], PrefillCaches(len(prompt) + 4), PrefixReuse(prefix, stats=stats))
    recomputed, _, expected_logits = prefill(loaded, [prompt], PrefillCaches(len(prompt) + 4), chunk_tokens=CHUNK)
    assert stats.prefix_reused_tokens == 3 * CHUNK
    assert torch.equal(logits, expected_logits), f"{family.name}: logits after the restored prefix differ"
    for index, (got, want) in enumerate(zip(restored.layers, recomputed.layers, strict=True)):
        assert torch.equal(got.keys[:, :, : len(prompt)], want.keys[:, :, : len(prompt)]), f"layer {index} keys"


@pytest.mark.parametrize("codec", sorted(CODEC_MATRIX))
@pytest.mark.parametrize("family", family_params())
def test_codecs_round_trip_the_familys_kv(family: Family, codec: str) -> None:
    loaded = family.build()
    cache, _, _ = prefill(loaded, [PROMPT], PrefillCaches(len(PROMPT)))
    for kind in ("keys", "values"):
        # [L, H_kv, T, D]: every layer's KV of the prompt, as a prefix store would ship it (codecs work on the host).
        tensor = torch.cat([getattr(layer, kind)[:, :, : len(PROMPT)] for layer in cache.layers]).cpu()
        params = {**CODEC_MATRIX[codec][0], **({"kind": kind} if "kind" in CODEC_MATRIX[codec][0] else {})}
        built = create_codec(codec, **params)
        decoded = built.decode(built.encode(tensor))
        assert torch.equal(decoded, built.reconstruct(tensor)), f"{family.name} {codec}: {kind} differ"


def test_soft_capped_attention_gives_the_eager_logits_bit_for_bit_and_the_cap_matters() -> None:
    loaded = family_named("gemma2").build()
    ids = torch.arange(5, 45, device=loaded.device)[None]
    with plain_attention(loaded), torch.inference_mode():
        expected = loaded.model(ids).logits
    cache = KVCache.allocate(loaded.architecture, 1, 64, loaded.dtype, loaded.device)
    assert torch.equal(forward(loaded.model, cache, ids), expected)
    uncapped = dataclasses.replace(family_named("gemma2"), overrides={
        **family_named("gemma2").overrides, "attn_logit_softcapping": None
    }).build()
    with plain_attention(uncapped), torch.inference_mode():
        assert not torch.equal(uncapped.model(ids).logits, expected)
