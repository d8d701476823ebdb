"""The embedded SmolLM2 on a ~2K-token real document: exact greedy decoding through kvlab's cache."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.cache import KVCache, forward
from kvlab.cli import main
from kvlab.data import document_token_ids
from kvlab.engine import generate
from kvlab.generation import GenerationConfig
from kvlab.models import LoadedModel
from tests.helpers import plain_attention, transformers_greedy, transformers_layers

pytestmark = pytest.mark.integration

QUESTION = "\n\nQuestion: what does the nonlocal statement do? Answer:"


@pytest.fixture(scope="module")
def long_prompt(embedded_model: LoadedModel) -> list[int]:
    question = embedded_model.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    return document_token_ids(embedded_model.tokenizer, 2000) + list(question)


def test_embedded_model_geometry(embedded_model: LoadedModel) -> None:
    arch = embedded_model.architecture
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert arch.max_context == 8192 and embedded_model.dtype == torch.float32


def test_greedy_equals_transformers_on_a_long_real_prompt(embedded_model: LoadedModel, long_prompt: list[int]) -> None:
    expected = transformers_greedy(embedded_model, long_prompt, max_new_tokens=48)
    output = generate(embedded_model, [long_prompt], GenerationConfig(max_new_tokens=48))
    assert output.requests[0].token_ids == expected


def test_packed_layers_stay_within_tolerance_of_transformers_layers_on_a_real_document(
    embedded_model: LoadedModel, long_prompt: list[int]
) -> None:
    """The embedded model loads with oneDNN-packed linear layers; transformers' own are the reference:
    every position's argmax equal, logits within 1e-5 of the largest (measured 2.6e-6 on 300 tokens)."""
    assert embedded_model.packed_weights
    reference = transformers_layers(embedded_model.model)
    ids = torch.tensor([long_prompt])
    with plain_attention(embedded_model), plain_attention(reference), torch.inference_mode():
        packed, expected = embedded_model.model(ids).logits[0], reference(ids).logits[0]
    mismatches = (packed.argmax(-1) != expected.argmax(-1)).nonzero()[:, 0].tolist()
    assert not mismatches, f"argmax differs at prompt positions {mismatches}"
    error = float((packed - expected).abs().max() / expected.abs().max())
    assert error < 1e-5, f"logits differ by {error:.2e} of the largest"


def test_verifying_k_tokens_in_one_forward_matches_k_sequential_steps(
    embedded_model: LoadedModel, long_prompt: list[int]
) -> None:
    continuation = generate(embedded_model, [long_prompt], GenerationConfig(max_new_tokens=40, ignore_eos=True))
    tokens = torch.tensor([long_prompt + continuation.requests[0].token_ids])
    prompt_length = len(long_prompt)
    cache = KVCache.allocate(embedded_model.architecture, 1, tokens.shape[1], embedded_model.dtype, "cpu")
    forward(embedded_model.model, cache, tokens[:, :prompt_length])
    snapshot = cache.clone()
    sequential = torch.cat(
        [forward(embedded_model.model, cache, tokens[:, t : t + 1]) for t in range(prompt_length, tokens.shape[1])],
        dim=1,
    )
    chunked = torch.cat(
        [
            forward(embedded_model.model, snapshot, tokens[:, t : t + 8])
            for t in range(prompt_length, tokens.shape[1], 8)
        ],
        dim=1,
    )
    mismatches = (sequential.argmax(-1) != chunked.argmax(-1)).nonzero()[:, 1].tolist()
    assert not mismatches, f"argmax differs at continuation positions {mismatches}"


def test_batch_of_real_prompts_equals_each_prompt_alone(embedded_model: LoadedModel, long_prompt: list[int]) -> None:
    prompts = [long_prompt[-300:], long_prompt[-700:], embedded_model.encode_prompt("Name three colours.")]
    config = GenerationConfig(max_new_tokens=16)
    batch = generate(embedded_model, prompts, config)
    for index, prompt in enumerate(prompts):
        alone = generate(embedded_model, [prompt], config).requests[0]
        assert batch.requests[index].token_ids == alone.token_ids, f"prompt {index}"


def test_cli_generate_raw_json_returns_transformers_greedy_ids(
    embedded_model: LoadedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "The three most important ideas of the Python execution model are"
    assert main(["generate", "--prompt", text, "--raw", "--max-new-tokens", "24", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_token_ids"] == embedded_model.encode_prompt(text, raw=True)
    assert result["token_ids"] == transformers_greedy(embedded_model, result["prompt_token_ids"], 24)
    assert result["text"] == embedded_model.decode(result["token_ids"])
    assert {"ttft_s", "decode_tokens_per_s", "new_tokens"} <= set(result["stats"])


def test_cli_applies_the_chat_template_without_raw(
    embedded_model: LoadedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--prompt", "Say hi.", "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert embedded_model.tokenizer.decode(result["prompt_token_ids"]).startswith("<|im_start|>system")
    assert result["prompt_token_ids"] == embedded_model.encode_prompt("Say hi.")


def test_cli_refuses_a_prompt_longer_than_the_context(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    prompt = tmp_path / "long.txt"
    prompt.write_text("word " * 9000)
    assert main(["generate", "--prompt-file", str(prompt), "--raw"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context of 8192 tokens" in err and len(err.strip().splitlines()) == 1
