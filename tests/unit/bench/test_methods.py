"""Method rows: parsing, validation, the engine per kind, and lossless output equal to full KV."""

from __future__ import annotations

import pytest

from kvlab.bench import methods
from kvlab.bench.methods import CATALOG, BenchMethod, parse_method, run_method
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig
from tests.helpers import tiny_llama


def test_catalog_labels_parse_to_their_rows() -> None:
    spec = parse_method("kivi-2")
    assert spec == CATALOG["kivi-2"] and spec.kind == "lossy"
    assert spec.compressor is not None and spec.compressor["name"] == "kivi" and spec.compressor["bits"] == 2
    assert parse_method("full").kind == "full" and parse_method("full").compressor is None


def test_any_compressor_setting_parses_and_records_every_parameter() -> None:
    spec = parse_method("snapkv:budget=64,window_size=8")
    assert spec.label == "snapkv-budget64-window_size8"
    assert spec.compressor is not None
    assert spec.compressor["budget"] == 64 and spec.compressor["window_size"] == 8 and "kernel_size" in spec.compressor


def test_lossless_spec_parses_the_draft_length() -> None:
    spec = parse_method("lossless:kivi:bits=4,num_draft_tokens=6")
    assert spec.kind == "lossless" and spec.num_draft_tokens == 6


def test_round_trip_through_dict() -> None:
    for spec in CATALOG.values():
        assert BenchMethod.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kivi-3", "unknown method 'kivi-3'; choose one of: full, kivi-2"),
        ("kivi:bits=3", "bits must be one of"),
        ("snapkv:nonsense=1", "has no parameter 'nonsense'"),
        ("lossless:kivi:num_draft_tokens=x", "num_draft_tokens must be an integer"),
    ],
)
def test_bad_method_strings_are_config_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_method(text)


def test_inconsistent_specs_are_refused() -> None:
    with pytest.raises(ConfigError, match="full KV takes no compressor"):
        BenchMethod("x", "full", {"name": "kivi", "bits": 2})
    with pytest.raises(ConfigError, match="unknown method kind 'fancy'"):
        BenchMethod("x", "fancy", {"name": "kivi"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_draft_tokens applies to lossless methods only"):
        BenchMethod("x", "lossy", {"name": "kivi"}, num_draft_tokens=4)


def test_ratio_sweep_expands_eviction_and_merging_rows_only() -> None:
    rows = (CATALOG["full"], CATALOG["snapkv-50"], CATALOG["snapkv-75"], CATALOG["cam-50"], CATALOG["kivi-2"],
            CATALOG["lossless-snapkv-75"])  # fmt: skip
    labels = [row.label for row in methods.expand_ratios(rows, (0.25, 0.875))]
    assert labels == ["full", "snapkv-25", "snapkv-87.5", "cam-25", "cam-87.5", "kivi-2", "lossless-snapkv-75"]
    swept = methods.expand_ratios(rows, (0.875,))[1]
    assert swept.compressor is not None and swept.compressor["compression_ratio"] == 0.875
    assert methods.expand_ratios(rows, ()) == rows


def test_ratios_outside_zero_one_are_rejected() -> None:
    with pytest.raises(ConfigError, match="in \\(0, 1\\)"):
        methods.expand_ratios((CATALOG["snapkv-50"],), (1.0,))


def test_catalog_labels_match_their_ratio_labels() -> None:
    # The README's tables and `kvlab bench` name a swept row and a catalog row alike.
    assert methods.ratio_label("snapkv", 0.75) == "snapkv-75" and "snapkv-75" in CATALOG


@pytest.mark.parametrize("label", ["lossless-kivi-2", "lossless-snapkv-75"])
def test_lossless_rows_reproduce_full_kv_output_token_for_token(label: str) -> None:
    loaded = tiny_llama()
    prompt = [(7 * i) % 90 + 3 for i in range(80)]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    full = run_method(loaded, CATALOG["full"], [prompt], config).requests[0].token_ids
    lossless = run_method(loaded, CATALOG[label], [prompt], config)
    assert lossless.requests[0].token_ids == full
    assert lossless.lossless is not None and lossless.lossless.rounds > 0
