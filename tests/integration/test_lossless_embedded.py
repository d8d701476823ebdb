"""Lossless decoding on the embedded model with a long real document: identical to plain greedy."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab import attention_kernels
from kvlab.attention_kernels import PIECES_MIN_KEYS
from kvlab.cli import main
from kvlab.compress import create_compressor
from kvlab.data import document_token_ids
from kvlab.engine import generate, generate_lossless
from kvlab.generation import GenerationConfig
from kvlab.lossless import LosslessConfig
from kvlab.models import LoadedModel

pytestmark = pytest.mark.integration

QUESTION = "\n\nQuestion: what does the global statement do? Answer:"


@pytest.fixture(scope="module")
def prompts(embedded_model: LoadedModel) -> list[list[int]]:
    question = list(embedded_model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"])
    document = document_token_ids(embedded_model.tokenizer, 1500)
    return [document + question, document[700:] + question]


@pytest.fixture(scope="module")
def plain_outputs(embedded_model: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    output = generate(embedded_model, prompts, GenerationConfig(max_new_tokens=40))
    return [request.token_ids for request in output.requests]


@pytest.mark.parametrize(
    ("name", "params", "draft_length"),
    [
        ("snapkv", {"compression_ratio": 0.9}, 4),
        ("kivi", {"bits": 2}, 16),
        ("streamingllm", {"compression_ratio": 0.9}, 3),
        ("turboquant", {"bits": 3}, 8),
    ],
)
def test_lossless_output_equals_plain_greedy(
    embedded_model: LoadedModel,
    prompts: list[list[int]],
    plain_outputs: list[list[int]],
    name: str,
    params: dict[str, object],
    draft_length: int | str,
) -> None:
    spec = LosslessConfig(create_compressor(name, **params), draft_length)  # type: ignore[arg-type]
    output = generate_lossless(embedded_model, prompts, GenerationConfig(max_new_tokens=40), spec)
    assert [request.token_ids for request in output.requests] == plain_outputs
    assert output.lossless is not None and output.lossless.num_accepted_tokens > 0


def test_lossless_output_with_an_automatic_draft_length_equals_plain_greedy(
    embedded_model: LoadedModel, prompts: list[list[int]], plain_outputs: list[list[int]]
) -> None:
    # Whether `auto` drafts at all is decided from this machine's timed forwards (a same-weight draft step
    # costs about a plain one on this model, so on a busy runner the planner rightly stays plain); what it
    # decides given costs is tested in tests/unit/lossless/test_planner.py. Here: whatever it decides, the
    # output is plain greedy's and every round is counted.
    spec = LosslessConfig(create_compressor("snapkv", compression_ratio=0.9), "auto")
    output = generate_lossless(embedded_model, prompts, GenerationConfig(max_new_tokens=40), spec)
    assert [request.token_ids for request in output.requests] == plain_outputs
    stats = output.lossless
    assert stats is not None and stats.num_plain_rounds <= stats.rounds
    # Each request's first token comes from its prefill, every other from a round: its verify's own token
    # and the drafts it accepted.
    emitted = sum(len(request.token_ids) for request in output.requests)
    assert emitted == len(prompts) + stats.rounds + stats.num_accepted_tokens


def test_lossless_output_with_int4_draft_weights_equals_plain_greedy(
    embedded_model: LoadedModel, prompts: list[list[int]], plain_outputs: list[list[int]]
) -> None:
    # The drafts read a 4-bit copy of the linear weights; verification stays on the exact model.
    spec = LosslessConfig(create_compressor("snapkv", compression_ratio=0.9), 4, draft_weights="int4")
    output = generate_lossless(embedded_model, prompts, GenerationConfig(max_new_tokens=40), spec)
    assert [request.token_ids for request in output.requests] == plain_outputs, "int4 drafts changed the output"
    assert output.lossless is not None and output.lossless.num_accepted_tokens > 0, "no int4 draft was accepted"


def test_lossy_decoding_from_a_small_cache_diverges(
    embedded_model: LoadedModel, prompts: list[list[int]], plain_outputs: list[list[int]]
) -> None:
    # The reason lossless decoding exists: the same compressor used directly changes the answer.
    output = generate(
        embedded_model,
        prompts[:1],
        GenerationConfig(max_new_tokens=40),
        compressor=create_compressor("streamingllm", budget=64),
    )
    assert output.requests[0].token_ids != plain_outputs[0]
    assert output.stats.kv_bytes_ratio > 10


def test_cli_lossless_json_reports_acceptance(embedded_model: LoadedModel, capsys: pytest.CaptureFixture[str]) -> None:
    text = "Explain what a Python code block is, in two sentences."
    argv = ["generate", "--prompt", text, "--max-new-tokens", "24", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--lossless", "--drafter", "kivi", "--drafter-arg", "bits=4", "--num-draft-tokens", "8"]) == 0
    lossless = json.loads(capsys.readouterr().out)
    assert lossless["token_ids"] == plain["token_ids"]
    assert {"acceptance_length", "rounds", "num_draft_tokens", "num_accepted_tokens", "num_plain_rounds",
            "num_lookup_rounds", "num_plans", "cost_model"} <= set(lossless["stats"])
    assert lossless["stats"]["acceptance_length"] >= 1.0
    # A fixed draft length leaves the planner only the source: no round of the 24 tokens drafts nothing but
    # a last one.
    assert lossless["stats"]["num_plain_rounds"] <= 1


# 1183 keys take the scores written out; past PIECES_MIN_KEYS the verify cuts the keys into pieces.
@pytest.mark.parametrize("context", [1183, PIECES_MIN_KEYS + 100])
def test_the_fast_verify_path_matches_the_masked_reference_on_a_real_document(
    embedded_model: LoadedModel, context: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.unit.test_attention import verify_logits_both_ways

    monkeypatch.setattr(attention_kernels, "key_pieces", lambda kv_heads: 2)  # as on 2 threads, on any machine
    document = document_token_ids(embedded_model.tokenizer, context + 17)
    fast, reference = verify_logits_both_ways(embedded_model, document[:context], document[context:])
    torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(fast.argmax(dim=-1), reference.argmax(dim=-1))
