"""Every compressor: identity, agreement with a reference re-implementation, error bounds, bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlab.cache import KVCache, forward
from kvlab.compress import CompressionContext, compressors, create_compressor
from kvlab.compress.turboquant import _dequantize_mse, _quantize_mse, lloyd_max_codebook
from kvlab.engine import generate
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig
from kvlab.quant.packing import pack_codes, unpack_codes
from tests.helpers import assert_identity_compression_is_bit_identical, tiny_llama
from tests.reference import eviction as ref_eviction
from tests.reference import quantization as ref_quantization

SCALING = 1 / math.sqrt(16)

# Every registered method with an easy and a hard setting (the matrix must cover the registry).
METHOD_MATRIX: dict[str, list[dict[str, object]]] = {
    "snapkv": [{"compression_ratio": 0.3}, {"compression_ratio": 0.9, "window_size": 8}],
    "snapkv_agnostic": [{"compression_ratio": 0.3}, {"compression_ratio": 0.9, "window_size": 8}],
    "h2o": [{"compression_ratio": 0.3}, {"budget": 12, "recent_ratio": 0.25}],
    "streamingllm": [{"compression_ratio": 0.3}, {"budget": 10, "num_sinks": 2}],
    "cam": [{"compression_ratio": 0.3}, {"compression_ratio": 0.85, "merge_span": 4}],
    "kivi": [{"bits": 8, "group_size": 16, "residual_length": 16}, {"bits": 2, "group_size": 8, "residual_length": 8}],
    "turboquant": [{"bits": 4}, {"bits": 2, "residual_length": 4}],
}
IDENTITY = {
    "snapkv": {"compression_ratio": 0.0},
    "snapkv_agnostic": {"compression_ratio": 0.0},
    "h2o": {"compression_ratio": 0.0},
    "streamingllm": {"compression_ratio": 0.0},
    "cam": {"compression_ratio": 0.0},
    "kivi": {"bits": 16},
    "turboquant": {"bits": 16},
}


def _random_kv(heads: int = 2, groups: int = 2, tokens: int = 40, dim: int = 16, seed: int = 0):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(heads * groups, tokens, dim, generator=generator)
    keys = torch.randn(heads, tokens, dim, generator=generator)
    values = torch.randn(heads, tokens, dim, generator=generator)
    return queries, keys, values


def test_the_matrix_covers_every_registered_method() -> None:
    assert sorted(METHOD_MATRIX) == compressors.names()
    assert sorted(IDENTITY) == compressors.names()


@pytest.mark.parametrize("name", sorted(IDENTITY))
def test_keeping_everything_gives_bit_identical_logits(name: str) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    ids = torch.randint(3, 96, (1, 48), generator=torch.Generator().manual_seed(7))
    assert_identity_compression_is_bit_identical(loaded, create_compressor(name, **IDENTITY[name]), ids, name)


@pytest.mark.parametrize("name", sorted(METHOD_MATRIX))
@pytest.mark.parametrize("setting", [0, 1], ids=["easy", "hard"])
def test_prefill_and_decode_store_the_expected_tokens_and_bytes(name: str, setting: int) -> None:
    loaded = tiny_llama(num_kv_heads=2)
    arch = loaded.architecture
    compressor = create_compressor(name, **METHOD_MATRIX[name][setting])
    prompt = torch.randint(3, 96, (60,), generator=torch.Generator().manual_seed(setting)).tolist()
    output = generate(loaded, [prompt], GenerationConfig(max_new_tokens=10, ignore_eos=True), compressor=compressor)
    stats = output.stats
    total_tokens = 60 + 10 - 1
    full_bytes = total_tokens * arch.kv_bytes_per_token()
    assert math.isclose(stats.kv_bytes_ratio, full_bytes / stats.kv_bytes)
    assert len(output.requests[0].token_ids) == 10
    cache = KVCache.allocate(arch, 1, 80, loaded.dtype, "cpu", compressor)
    forward(loaded.model, cache, torch.tensor([prompt]), compress=True)
    for token in range(5):
        forward(loaded.model, cache, torch.tensor([[token + 3]]))
    layer = cache.layers[0]
    if hasattr(compressor, "num_kept"):
        kept = compressor.num_kept(60)  # type: ignore[attr-defined]
        assert layer.lengths == [kept + 5]  # type: ignore[attr-defined]
        index_bytes = kept * arch.num_kv_heads * 4
        assert layer.nbytes() == (kept + 5) * arch.kv_bytes_per_token() // arch.num_layers + index_bytes
    else:
        quantized = layer.quantized_lengths[0]  # type: ignore[attr-defined]
        assert quantized == compressor.num_to_quantize(65)  # type: ignore[attr-defined]
        assert layer.lengths == [65]  # type: ignore[attr-defined]
        assert layer.nbytes() < 65 * arch.kv_bytes_per_token() // arch.num_layers
    assert stats.kv_bytes_ratio > 1.0


def test_snapkv_matches_the_reference() -> None:
    queries, keys, values = _random_kv(seed=1)
    for pooling in ("max", "avg"):
        compressor = create_compressor("snapkv", budget=15, window_size=6, kernel_size=5, pooling=pooling)
        result = compressor.compress(keys, values, CompressionContext(queries, SCALING, 0))
        expected = ref_eviction.snapkv_indices(queries.numpy(), keys.numpy(), SCALING, 6, 5, pooling, 15)
        assert result.kept_indices.tolist() == expected.tolist(), pooling  # type: ignore[attr-defined]
        assert torch.equal(result.keys[0], keys[0, result.kept_indices[0]])  # type: ignore[attr-defined]


def test_h2o_matches_the_reference() -> None:
    queries, keys, values = _random_kv(seed=2)
    result = create_compressor("h2o", budget=14, recent_ratio=0.3).compress(
        keys, values, CompressionContext(queries, SCALING, 0)
    )
    expected = ref_eviction.h2o_indices(queries.numpy(), keys.numpy(), SCALING, 14, 0.3)
    assert result.kept_indices.tolist() == expected.tolist()  # type: ignore[attr-defined]


def test_streamingllm_matches_the_reference() -> None:
    _, keys, values = _random_kv(seed=3)
    result = create_compressor("streamingllm", budget=11, num_sinks=3).compress(
        keys, values, CompressionContext(None, SCALING, 0)
    )
    assert result.kept_indices.tolist() == ref_eviction.streamingllm_indices(2, 40, 3, 11).tolist()  # type: ignore[attr-defined]


def test_cam_matches_the_reference_and_keeps_keys() -> None:
    queries, keys, values = _random_kv(seed=4)
    compressor = create_compressor("cam", budget=12, num_sinks=2, merge_span=3, window_size=5, sampling="expected")
    result = compressor.compress(keys, values, CompressionContext(queries, SCALING, 0))
    settings = ref_eviction.CaMSettings(num_sinks=2, budget=12, span=3, window=5)
    kept, merged = ref_eviction.cam_values(queries.numpy(), keys.numpy(), values.numpy(), SCALING, settings)
    assert result.kept_indices.tolist() == kept.tolist()  # type: ignore[attr-defined]
    torch.testing.assert_close(result.values, torch.from_numpy(merged).float(), rtol=1e-5, atol=1e-5)  # type: ignore[attr-defined]
    assert torch.equal(result.keys[1], keys[1, result.kept_indices[1]])  # type: ignore[attr-defined]
    assert not torch.equal(result.values[0], values[0, result.kept_indices[0]]), "merging changed nothing"  # type: ignore[attr-defined]


def test_cam_merges_alike_whether_it_visits_evicted_positions_or_every_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvlab.compress import cam

    generator = torch.Generator().manual_seed(3)
    values = torch.randn(3, 40, 8, generator=generator)
    kept_mask = torch.rand(3, 40, generator=generator) > 0.6
    weights = torch.rand(3, 40, generator=generator)
    visiting_evicted = cam.merge_forward(values, kept_mask, weights, span=4)
    monkeypatch.setattr(cam, "_merge_positions", lambda mask: range(mask.shape[1]))
    assert torch.equal(cam.merge_forward(values, kept_mask, weights, span=4), visiting_evicted)


def test_cam_bernoulli_draws_are_seeded() -> None:
    queries, keys, values = _random_kv(seed=5)
    context = CompressionContext(queries, SCALING, 0)
    first = create_compressor("cam", budget=12, seed=1).compress(keys, values, context)
    again = create_compressor("cam", budget=12, seed=1).compress(keys, values, context)
    assert torch.equal(first.values, again.values)  # type: ignore[attr-defined]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_codes_match_the_reference_and_errors_stay_within_half_a_step(bits: int) -> None:
    _, keys, values = _random_kv(tokens=32, seed=bits)
    compressor = create_compressor("kivi", bits=bits, group_size=8)
    # Keys: one group per (head, 8-token block, channel); values: per (head, token, 8 channels).
    key_block = compressor.quantize_keys(keys, 0)  # type: ignore[attr-defined]
    key_groups = keys.reshape(2, 4, 8, 16).permute(0, 1, 3, 2).reshape(-1, 8).numpy()
    codes, scales, zeros = ref_quantization.kivi_quantize(key_groups, bits)
    ours = key_block.groups()
    assert np.array_equal(ours.codes.reshape(2, 4, 8, 16).permute(0, 1, 3, 2).reshape(-1, 8).numpy(), codes)
    assert np.array_equal(ours.scales.reshape(-1).numpy(), scales)
    assert np.array_equal(ours.zeros.reshape(-1).numpy(), zeros)
    value_block = compressor.quantize_values(values, 0)  # type: ignore[attr-defined]
    value_codes, value_scales, _ = ref_quantization.kivi_quantize(values.reshape(-1, 8).numpy(), bits)
    assert np.array_equal(value_block.groups().codes.reshape(-1, 8).numpy(), value_codes)
    for block, tensor, step in ((key_block, keys, scales), (value_block, values, value_scales)):
        error = (compressor.dequantize_keys(block) - tensor).abs()  # type: ignore[attr-defined]
        assert float(error.max()) <= float(step.astype(np.float32).max()) / 2 * (1 + 1e-6)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8])
def test_packed_codes_round_trip_exactly(bits: int) -> None:
    codes = np.random.default_rng(bits).integers(0, 2**bits, 1001).astype(np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.size == math.ceil(1001 * bits / 8)
    assert np.array_equal(unpack_codes(packed, bits, 1001), codes)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_turboquant_codes_match_the_reference_rotation(bits: int) -> None:
    _, _, values = _random_kv(tokens=20, seed=bits)
    compressor = create_compressor("turboquant", bits=bits, seed=3)
    block = compressor.quantize_values(values, layer_idx=5)  # type: ignore[attr-defined]
    seed = compressor._seed(5, "values")  # type: ignore[attr-defined]
    signs = (torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1).numpy()
    _, centroids = lloyd_max_codebook(16, bits)
    expected, margin = ref_quantization.turboquant_mse_codes(values.numpy(), signs, centroids)
    ours = unpack_codes(block.packed.numpy(), bits, values.numel()).reshape(values.shape)
    # float32 (kvlab) and float64 (reference) rotations may round a coordinate lying on a decision
    # boundary to either side; everywhere else the codes must be identical.
    differs = ours != expected
    assert (margin[differs] < 1e-5).all(), f"codes differ away from boundaries at {np.argwhere(differs)}"
    assert differs.mean() < 0.01


@pytest.mark.parametrize(("bits", "lloyd_max_gaussian"), [(1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)])
def test_turboquant_mse_distortion_is_within_the_papers_bound(bits: int, lloyd_max_gaussian: float) -> None:
    # Theorem 1: D_mse <= sqrt(3) * pi / 2 * 4**-bits for unit vectors; in high dimension the optimum
    # approaches the Lloyd-Max distortion of a Gaussian coordinate.
    vectors = torch.randn(1, 4000, 64, generator=torch.Generator().manual_seed(0))
    vectors /= vectors.norm(dim=-1, keepdim=True)
    block, reconstruction = _quantize_mse(vectors, bits, seed=11)
    distortion = float(((reconstruction - vectors) ** 2).sum(dim=-1).mean())
    assert distortion <= math.sqrt(3) * math.pi / 2 * 4**-bits
    assert distortion <= 1.05 * lloyd_max_gaussian
    assert torch.equal(_dequantize_mse(block), reconstruction)


def test_turboquant_key_inner_products_are_unbiased() -> None:
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(1, 1, 64, generator=generator)
    query = torch.randn(64, generator=generator)
    estimates = []
    for seed in range(400):
        compressor = create_compressor("turboquant", bits=2, seed=seed)
        reconstruction = compressor.dequantize_keys(compressor.quantize_keys(key, 0))  # type: ignore[attr-defined]
        estimates.append(float(reconstruction[0, 0] @ query))
    exact = float(key[0, 0] @ query)
    spread = float(np.std(estimates)) / math.sqrt(len(estimates))
    assert abs(np.mean(estimates) - exact) < 4 * spread, (np.mean(estimates), exact, spread)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("snapkv", {"compression_ratio": 0.5, "budget": 10}, "not both"),
        ("snapkv", {"compression_ratio": 1.0}, "compression_ratio must be in"),
        ("snapkv", {"kernel_size": 4}, "odd"),
        ("kivi", {"bits": 3}, "bits must be one of 2, 4, 8, 16"),
        ("turboquant", {"bits": 8}, "bits must be one of 2, 3, 4, 16"),
        ("h2o", {"recent_ratio": 2.0}, "recent_ratio"),
        ("cam", {"sampling": "random"}, "must be one of"),
        ("snapkv", {"windowsize": 3}, "has no parameter 'windowsize'"),
        ("zipkv", {}, "unknown compressor 'zipkv'; choose one of: cam, h2o, kivi"),
    ],
)
def test_bad_parameters_raise_config_errors(name: str, params: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_compressor(name, **params)


def test_a_budget_larger_than_the_prompt_is_refused() -> None:
    _, keys, values = _random_kv(tokens=20)
    with pytest.raises(ConfigError, match="budget 30 is larger than the prompt \\(20 tokens\\)"):
        create_compressor("streamingllm", budget=30).compress(keys, values, CompressionContext(None, SCALING, 0))


def test_compressed_caches_refuse_to_roll_back_into_compressed_storage() -> None:
    loaded = tiny_llama(num_kv_heads=2)
    for name, params in (("snapkv", {"budget": 10}), ("kivi", {"bits": 4, "group_size": 4, "residual_length": 4})):
        cache = KVCache.allocate(loaded.architecture, 1, 64, loaded.dtype, "cpu", create_compressor(name, **params))
        forward(loaded.model, cache, torch.randint(3, 96, (1, 30)), compress=True)
        forward(loaded.model, cache, torch.randint(3, 96, (1, 3)))
        cache.crop(31)
        with pytest.raises(ValueError, match="cannot roll back"):
            cache.crop(20)


# ----- parameter bounds: no parameter asks for unbounded work, memory or a seed past the generator

INTEGER_PARAMETERS = [
    (name, parameter.name)
    for name in compressors.names()
    for parameter in compressors.parameters(name)
    if parameter.type in ("int", "int | None")
]


def test_the_bounds_matrix_covers_every_compressor() -> None:
    assert {name for name, _ in INTEGER_PARAMETERS} == set(compressors.names())


@pytest.mark.parametrize(("name", "parameter"), INTEGER_PARAMETERS)
@pytest.mark.parametrize("value", [1 << 63, -(1 << 63), 10**30])
def test_an_integer_parameter_out_of_range_is_a_config_error_naming_it(name: str, parameter: str, value: int) -> None:
    with pytest.raises(ConfigError, match=parameter):
        create_compressor(name, **{parameter: value})


def test_a_budget_larger_than_the_prompt_is_refused_before_compressing() -> None:
    compressor = create_compressor("snapkv", budget=30)
    with pytest.raises(ConfigError, match="budget 30 is larger than the prompt \\(20 tokens\\)"):
        compressor.check_prompt(20)
    compressor.check_prompt(30)
    create_compressor("kivi").check_prompt(1)
