"""benchmarks/draft_oracle.py without a real model: its drafter-spec grammar, the hindsight oracle, and the
shaping of its table rows and JSON records (every printed figure found within its one record, as
tests/unit/test_doc_figures.py checks doc tables against JSON); one tiny-model run of a tier."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvlab.lossless.stats import LosslessStats
from kvlab.models import LoadedModel
from tests.unit.test_doc_figures import figures_in, json_numbers

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "draft_oracle.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("draft_oracle_bench", SCRIPT)
    assert spec is not None and spec.loader is not None, f"cannot load {SCRIPT}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are built
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize(
    ("text", "label", "compressor", "params", "lookup", "weights"),
    [
        ("snapkv-0.9", "snapkv-0.9", "snapkv", {"compression_ratio": 0.9}, False, "same"),
        ("ngram+snapkv-0.9", "ngram+snapkv-0.9", "snapkv", {"compression_ratio": 0.9}, True, "same"),
        ("snapkv-0.9@int8", "snapkv-0.9@int8", "snapkv", {"compression_ratio": 0.9}, False, "int8"),
        ("snapkv-0.9@same", "snapkv-0.9", "snapkv", {"compression_ratio": 0.9}, False, "same"),
        ("kivi-4", "kivi-4", "kivi", {"bits": 4}, False, "same"),
        ("ngram+kivi-2@int4", "ngram+kivi-2@int4", "kivi", {"bits": 2}, True, "int4"),
        ("streamingllm-0.5@bf16", "streamingllm-0.5@bf16", "streamingllm", {"compression_ratio": 0.5}, False, "bf16"),
    ],
)
def test_a_valid_drafter_spec_names_its_compressor_budget_lookup_and_weights(
    bench: ModuleType, text: str, label: str, compressor: str, params: dict[str, Any], lookup: bool, weights: str
) -> None:
    spec = bench.parse_drafter(text)
    assert (spec.label, spec.compressor, spec.params, spec.prompt_lookup, spec.draft_weights) == (
        label, compressor, params, lookup, weights)
    assert spec.drafter_name == ("ngram+" if lookup else "") + compressor


def test_drafters_of_one_compressor_and_budget_share_their_prefilled_caches(bench: ModuleType) -> None:
    keys = {bench.parse_drafter(text).cache_key for text in bench.DEFAULT_DRAFTERS}
    assert len(keys) == 1
    assert bench.parse_drafter("kivi-4").cache_key not in keys


def test_a_drafter_setting_is_a_lossless_decode_setting(bench: ModuleType) -> None:
    setting = bench.parse_drafter("ngram+snapkv-0.9@int8").setting(8)
    assert setting == ("ngram+snapkv-0.9@int8 k=8", "lossless", "ngram+snapkv", {"compression_ratio": 0.9}, 8, "int8")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("snapkv", "expected [ngram+]METHOD-VALUE[@WEIGHTS]"),
        ("snapkv-", "expected [ngram+]METHOD-VALUE[@WEIGHTS]"),
        ("-0.9", "expected [ngram+]METHOD-VALUE[@WEIGHTS]"),
        ("ngram+", "expected [ngram+]METHOD-VALUE[@WEIGHTS]"),
        ("nosuch-0.9", "unknown compressor 'nosuch'"),
        ("snapkv-abc", "snapkv's compression_ratio must be float"),
        ("kivi-0.9", "kivi's bits must be int"),
        ("kivi-3", "bits"),
        ("snapkv-1.5", "compression_ratio"),
        ("snapkv-0.9@fp8", "draft weights after '@' must be one of same, bf16, int8, int4, got 'fp8'"),
        ("snapkv-0.9@", "draft weights after '@' must be one of"),
    ],
)
def test_an_invalid_drafter_spec_says_what_is_wrong(bench: ModuleType, text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as raised:
        bench.parse_drafter(text)
    assert says in str(raised.value) and repr(text) in str(raised.value), str(raised.value)


def test_argparse_shows_the_spec_error(bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.argv", ["draft_oracle.py", "--drafters", "snapkv-0.9@fp8"])
    with pytest.raises(SystemExit):
        bench.parse_args()
    assert "draft weights after '@' must be one of" in capsys.readouterr().err


def test_the_oracle_is_the_fastest_fixed_length_or_plain(bench: ModuleType) -> None:
    assert bench.hindsight_oracle(10.0, {2: 11.0, 4: 14.0, 8: 12.5}) == ("k=4", 14.0)
    assert bench.hindsight_oracle(10.0, {2: 9.0, 4: 8.0}) == ("plain", 10.0)
    assert bench.hindsight_oracle(10.0, {}) == ("plain", 10.0)


def test_a_tie_goes_to_plain_then_to_the_shorter_length(bench: ModuleType) -> None:
    assert bench.hindsight_oracle(12.0, {8: 12.0, 2: 12.0}) == ("plain", 12.0)
    assert bench.hindsight_oracle(10.0, {16: 12.0, 4: 12.0}) == ("k=4", 12.0)


def auto_stats(cost_model: bool) -> LosslessStats:
    """Four rounds of one sequence; with `cost_model`, the engine's fit over 37 forwards (none: 0 and None)."""
    stats = LosslessStats()
    for drafted, accepted, looked_up in [(6, 4, False), (0, 0, False), (10, 10, True), (3, 0, False)]:
        stats.record_round(drafted, accepted, looked_up)
    stats.cost_model_mre = 0.1234 if cost_model else None
    stats.cost_model_ticks = 37 if cost_model else 0
    return stats


def a_record(bench: ModuleType, cost_model: bool = True, fixed_tokens: list[list[int]] | None = None) -> dict[str, Any]:
    tokens = [[5, 6, 7]]
    plain = (bench.Run(10.0, tokens), bench.Run(10.0, tokens), bench.Run(12.0, tokens))
    fixed = {2: bench.Run(12.1, fixed_tokens or tokens, LosslessStats()), 8: bench.Run(15.4, tokens, LosslessStats())}
    where = {"prompt": "doc", "context": 4096, "batch": 1, "tier": "emulated:2", "new_tokens": 128}
    return bench.drafter_record(where, "snapkv-0.9", plain, bench.Run(14.3, tokens, auto_stats(cost_model)), fixed)


def test_a_record_sets_auto_and_the_oracle_against_the_mean_of_plain_before_and_after(bench: ModuleType) -> None:
    record = a_record(bench)
    assert record["plain_tokens_per_s"] == 11.0 and record["plain_tokens_per_s_before_after"] == [10.0, 12.0]
    assert (record["auto_vs_plain"], record["oracle"], record["oracle_vs_plain"], record["auto_vs_oracle"]) == (
        1.3, "k=8", 1.4, 0.93)
    assert record["fixed_vs_plain"] == {"2": 1.1, "8": 1.4}
    assert (record["auto_rounds"], record["auto_lookup_rounds"], record["auto_plain_rounds"]) == (4, 1, 1)
    assert (record["auto_mean_num_draft_tokens"], record["auto_acceptance_length"]) == (4.8, 4.5)
    assert (record["cost_model_mre"], record["cost_model_ticks"]) == (0.12, 37)
    assert record["identical"] and all(record["identical_by_setting"].values())
    assert json.loads(json.dumps(record)) == record


def test_a_run_whose_tokens_differ_from_plain_marks_the_record_and_its_row(bench: ModuleType) -> None:
    record = a_record(bench, fixed_tokens=[[5, 6, 8]])
    assert not record["identical"] and record["identical_by_setting"] == {"auto": True, "k=2": False, "k=8": True}
    assert bench.table_line(record, [2, 8]).endswith("| NO |")


def test_a_table_row_prints_every_column_from_its_record(bench: ModuleType) -> None:
    header = bench.table_header([2, 4, 8])
    line = bench.table_line(a_record(bench), [2, 4, 8])
    assert header.splitlines()[0].count("|") == line.count("|") == header.splitlines()[1].count("|")
    assert line == ("| doc | 4096 | 1 | emulated:2 | snapkv-0.9 | 11.0 | 1.30x | 1.40x (k=8) | 0.93x | 1.10x | - "
                    "| 1.40x | 4.8 | 4.50 | 1 / 1 | 12% (37) | yes |")


def test_a_missing_cost_model_prints_n_a(bench: ModuleType) -> None:
    record = a_record(bench, cost_model=False)
    assert record["cost_model_mre"] is None and record["cost_model_ticks"] == 0
    assert "| n/a |" in bench.table_line(record, [2, 8])


@pytest.mark.parametrize("cost_model", [True, False])
def test_every_figure_of_a_row_is_found_in_its_one_record(bench: ModuleType, cost_model: bool) -> None:
    record = a_record(bench, cost_model)
    numbers = json_numbers(record)
    for figure in figures_in(bench.table_line(record, [2, 8])):
        assert any(figure.matches(number) for number in numbers), f"{figure.text} is not in {record}"


def test_a_tier_runs_plain_around_each_drafter_and_matches_its_tokens(
    bench: ModuleType, tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny random model, 48-token prompts, 4 new tokens: the runs' order, one record per drafter, every
    lossless run identical to plain."""
    order: list[str] = []
    decode = bench.decode

    def noting(loaded: LoadedModel, prompts: list[list[int]], setting: tuple, prefilled: Any,  # type: ignore[type-arg]
               config: Any) -> Any:
        # The untimed runs that settle each drafter's calibration first decode 2 tokens, the timed ones 4.
        order.append(setting[0] if config.max_new_tokens == 4 else f"untimed {setting[0]}")
        return decode(loaded, prompts, setting, prefilled, config)

    monkeypatch.setattr(bench, "decode", noting)
    drafters = [bench.parse_drafter("snapkv-0.5"), bench.parse_drafter("ngram+snapkv-0.5")]
    prompts = [[(7 * i + row) % 90 + 3 for i in range(48)] for row in range(2)]
    prefills = {drafters[0].cache_key: bench.prefill_all(tiny_model, prompts, "snapkv", {"compression_ratio": 0.5})}
    where = {"prompt": "test", "context": 48, "batch": 2, "tier": "memory", "new_tokens": 4}
    args = argparse.Namespace(new_tokens=4, lengths=[2], repeats=1)
    records = bench.measure_tier(tiny_model, prompts, where, drafters, prefills, args)
    assert order == ["untimed snapkv-0.5 k=auto", "untimed ngram+snapkv-0.5 k=auto",
                     "plain full KV", "snapkv-0.5 k=auto", "snapkv-0.5 k=2", "plain full KV",
                     "ngram+snapkv-0.5 k=auto", "ngram+snapkv-0.5 k=2", "plain full KV"]
    assert [record["drafter"] for record in records] == ["snapkv-0.5", "ngram+snapkv-0.5"]
    assert all(record["identical"] for record in records), records
    assert records[1]["plain_tokens_per_s_before_after"][0] == records[0]["plain_tokens_per_s_before_after"][1]
    # Repeats alternate the order, with plain between them; each setting's rate is the mean of its runs.
    order.clear()
    args = argparse.Namespace(new_tokens=4, lengths=[2, 4], repeats=2)
    records = bench.measure_tier(tiny_model, prompts, where, drafters[:1], prefills, args)
    assert order == ["untimed snapkv-0.5 k=auto",
                     "plain full KV", "snapkv-0.5 k=auto", "snapkv-0.5 k=2", "snapkv-0.5 k=4", "plain full KV",
                     "snapkv-0.5 k=4", "snapkv-0.5 k=2", "snapkv-0.5 k=auto", "plain full KV"]
    assert records[0]["repeats"] == 2 and records[0]["identical"], records
