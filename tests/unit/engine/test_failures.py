"""Failures say so: a request whose prefill, forward or round raises stops with stop_reason "error" and
the failure's message, never "cancelled" or anything that looks like an answer; the offline front doors
raise it; and lossless decoding in half precision is warned about once per process."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlab.bench import BenchConfig, parse_method, run_benchmark, runner
from kvlab.bench.results import PREDICTIONS_FILE, read_predictions
from kvlab.compress import create_compressor
from kvlab.engine import Engine, Request, generate, generate_lossless
from kvlab.engine import tick as engine_module
from kvlab.engine.sequence import Sequence
from kvlab.generation import GenerationConfig, reference_generate
from kvlab.lossless import LosslessConfig
from kvlab.lossless import config as lossless_config
from kvlab.lossless import round as lossless_round
from kvlab.models import LoadedModel
from tests.helpers import tiny_llama

CHUNK = 16
PROMPTS = [[5 + (i * 7 + j * 3) % 80 for j in range(20 + 9 * i)] for i in range(3)]
CONFIG = GenerationConfig(max_new_tokens=10, ignore_eos=True)
WARNING_LOGGER = "kvlab.lossless.config"


@pytest.fixture(scope="module")
def model() -> LoadedModel:
    return tiny_llama(num_kv_heads=2, seed=5)


def run(engine: Engine, requests: list[Request]) -> list[int]:
    ids = [engine.add_request(request) for request in requests]
    while engine.num_unfinished():
        engine.step()
    return ids


def reference(model: LoadedModel, prompt: list[int], config: GenerationConfig = CONFIG) -> list[int]:
    return reference_generate(model, [prompt], config).requests[0].token_ids


def lossless() -> LosslessConfig:
    return LosslessConfig(create_compressor("snapkv", budget=12), 3)


def failing_compressor(monkeypatch: pytest.MonkeyPatch) -> Any:
    compressor = create_compressor("snapkv", budget=12)

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("compressor crashed")

    monkeypatch.setattr(type(compressor), "compress", crash)
    return compressor


def assert_failed(engine: Engine, request_id: int, message: str) -> None:
    output, error = engine.output(request_id), engine.error(request_id)
    assert output.stop_reason == "error", f"a failed request must say so, not {output.stop_reason!r}"
    assert isinstance(error, BaseException), "Engine.error keeps the exception itself"
    assert output.error == f"{type(error).__name__}: {error}" and message in output.error, output.error


def assert_answered(engine: Engine, request_id: int, expected: list[int]) -> None:
    output = engine.output(request_id)
    assert (output.stop_reason, output.error, engine.error(request_id)) == ("length", None, None)
    assert output.token_ids == expected


# ----- the engine: stop_reason "error" and the message


def test_a_request_whose_prefill_fails_says_error_and_the_others_answer(model: LoadedModel) -> None:
    engine = Engine(model)
    ids = run(engine, [Request(PROMPTS[0], CONFIG), Request([999] * 4, CONFIG), Request(PROMPTS[2], CONFIG)])
    assert_failed(engine, ids[1], "")
    assert engine.output(ids[1]).token_ids == []
    for request_id, prompt in ((ids[0], PROMPTS[0]), (ids[2], PROMPTS[2])):
        assert_answered(engine, request_id, reference(model, prompt))


def test_a_compressor_crash_on_chunked_prefill_says_error(model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """How a compressor crash on chunked prefill once stayed hidden: the request said "cancelled"."""
    compressor = failing_compressor(monkeypatch)
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, prefill_chunk_tokens=CHUNK)
    engine = Engine(model)
    ids = run(engine, [Request(PROMPTS[1], config, compressor=compressor), Request(PROMPTS[0], CONFIG)])
    assert_failed(engine, ids[0], "RuntimeError: compressor crashed")
    assert_answered(engine, ids[1], reference(model, PROMPTS[0]))


def test_a_failing_forward_fails_the_requests_it_carried_with_their_tokens_so_far(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"count": 0}
    run_batch = engine_module.run_batch

    def failing_third_forward(*args: Any, **kwargs: Any) -> Any:
        calls["count"] += 1
        if calls["count"] == 3:
            raise RuntimeError("device lost")
        return run_batch(*args, **kwargs)

    monkeypatch.setattr(engine_module, "run_batch", failing_third_forward)
    engine = Engine(model)
    ids = run(engine, [Request(prompt, CONFIG) for prompt in PROMPTS])
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        assert_failed(engine, request_id, "RuntimeError: device lost")
        tokens = engine.output(request_id).token_ids
        assert 0 < len(tokens) < CONFIG.max_new_tokens and tokens == reference(model, prompt)[: len(tokens)]


def test_a_lossless_round_that_raises_says_error(model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("verify crashed")

    monkeypatch.setattr(lossless_round, "accept_drafts", crash)
    engine = Engine(model)
    ids = run(engine, [Request(PROMPTS[0], CONFIG, lossless=lossless()), Request(PROMPTS[1], CONFIG)])
    assert_failed(engine, ids[0], "ValueError: verify crashed")
    assert_answered(engine, ids[1], reference(model, PROMPTS[1]))


def test_a_cancelled_request_says_cancelled_and_names_no_error(model: LoadedModel) -> None:
    engine = Engine(model)
    request_id = engine.add_request(Request(PROMPTS[0], GenerationConfig(max_new_tokens=50, ignore_eos=True)))
    engine.step()
    engine.cancel(request_id)
    output = engine.output(request_id)
    assert (output.stop_reason, output.error, engine.error(request_id)) == ("cancelled", None, None)


def test_a_failure_after_a_stop_rule_ended_the_request_keeps_its_reason(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its output is complete: it keeps "length" and names no error; `Engine.error` still has the failure."""
    advance = Sequence.advance

    def advance_then_fail_once_stopped(self: Sequence, logits: torch.Tensor) -> None:
        advance(self, logits)
        if self.stop_reason is not None:
            raise RuntimeError("failed after the last token")

    monkeypatch.setattr(Sequence, "advance", advance_then_fail_once_stopped)
    engine = Engine(model)
    (request_id,) = run(engine, [Request(PROMPTS[0], CONFIG)])
    output = engine.output(request_id)
    assert (output.stop_reason, output.error) == ("length", None)
    assert output.token_ids == reference(model, PROMPTS[0])
    assert isinstance(engine.error(request_id), RuntimeError)


# ----- the offline front doors raise what failed a request


def test_generate_raises_what_failed_a_request_as_it_was(model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    compressor = failing_compressor(monkeypatch)
    with pytest.raises(RuntimeError, match="compressor crashed"):
        generate(model, PROMPTS[:2], CONFIG, compressor=compressor)


def test_generate_lossless_raises_what_failed_a_round(model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("verify crashed")

    monkeypatch.setattr(lossless_round, "accept_drafts", crash)
    with pytest.raises(ValueError, match="verify crashed"):
        generate_lossless(model, PROMPTS[:2], CONFIG, lossless())


def test_the_bench_records_no_result_for_a_failed_request(
    model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run stops with the failure; the cell holds no record of the sample, so a resumed run retries it."""
    monkeypatch.setattr(runner, "code_revision", lambda: "revision-a")
    failing_compressor(monkeypatch)  # every snapkv compressor crashes, the one the bench builds too
    config = BenchConfig(tasks=({"name": "squad", "context_tokens": 96, "max_new_tokens": 4},),
                         methods=(parse_method("snapkv-50"),), samples=1, out=str(tmp_path), models=("tiny",),
                         warmup=False)
    with pytest.raises(RuntimeError, match="compressor crashed"):
        run_benchmark(config, loaded_models={"tiny": model})
    predictions = tmp_path / "tiny" / "squad" / "snapkv-50" / PREDICTIONS_FILE
    assert read_predictions(predictions) == [], "a failed request must not be recorded as a result"


# ----- lossless decoding in half precision: warned about once per process


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lossless_config, "_inexact_warned", False)


def half_precision_model() -> LoadedModel:
    loaded = tiny_llama(num_kv_heads=2, seed=5, packed_weights=False)
    loaded.model.to(torch.bfloat16)
    return loaded


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == WARNING_LOGGER and record.levelno == logging.WARNING]


@pytest.mark.usefixtures("fresh_warning")
def test_lossless_decoding_in_bfloat16_is_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    half = half_precision_model()
    assert half.dtype == torch.bfloat16
    with caplog.at_level(logging.WARNING, logger=WARNING_LOGGER):
        run(Engine(half), [Request(prompt, CONFIG, lossless=lossless()) for prompt in PROMPTS[:2]])
        generate_lossless(half, [PROMPTS[2]], CONFIG, lossless())  # another engine, the same process
    warnings = warnings_logged(caplog)
    assert len(warnings) == 1, f"expected one warning for the process, got {warnings}"
    assert "bfloat16" in warnings[0] and "only in float32" in warnings[0], warnings[0]


@pytest.mark.usefixtures("fresh_warning")
def test_lossless_decoding_in_float32_and_plain_decoding_in_bfloat16_are_not_warned_about(
    model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=WARNING_LOGGER):
        run(Engine(model), [Request(prompt, CONFIG, lossless=lossless()) for prompt in PROMPTS[:2]])
        run(Engine(half_precision_model()), [Request(PROMPTS[0], CONFIG)])
    assert warnings_logged(caplog) == []


def test_only_float32_is_lossless_exact() -> None:
    assert lossless_config.lossless_exact(torch.float32)
    assert not lossless_config.lossless_exact(torch.bfloat16)
    assert not lossless_config.lossless_exact(torch.float16)
