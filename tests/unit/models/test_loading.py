"""Loading local models of every family: transformers directories and GGUF files, written here.

A directory made by `save_pretrained`, or a float32 GGUF file made by `gguf_files.write_gguf`, must
load with the original's weights bit for bit and generate as transformers does. What kvlab cannot
load (remote code, an unknown model type, a GGUF architecture transformers cannot read, a prompt
past the context) is a `ConfigError` that says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvlab.cli import main
from kvlab.engine import generate
from kvlab.errors import ConfigError
from kvlab.generation import GenerationConfig
from kvlab.models import EMBEDDED_MODELS, LoadedModel, load_model
from tests.families import TEST_DEVICE, Family, family_named, family_params
from tests.helpers import tiny_tokenizer, transformers_greedy
from tests.unit.models.gguf_files import write_gguf

PROMPT = [(5 * i + 7) % 90 + 3 for i in range(24)]

GGUF_UNREADABLE: dict[str, str] = {
    "olmo2": "transformers has no GGUF reader for olmo2",
    "gpt_neox": "transformers has no GGUF reader for gptneox",
}
"""Families whose GGUF files transformers cannot read: loading one is a ConfigError naming the architecture."""

GGUF_READS_AS: dict[str, str] = {
    "mistral": "llama",
}
"""GGUF has no Mistral architecture: Mistral files say "llama" and carry no sliding window, so
transformers (and hence kvlab) load them as Llama, full attention."""


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF conversions land in this test's directory, not the user's cache."""
    monkeypatch.setenv("KVLAB_CACHE_DIR", str(tmp_path / "kvlab-cache"))


def assert_same_weights(family: Family, loaded: LoadedModel) -> None:
    original = family.build_hf().state_dict()
    restored = loaded.model.state_dict()
    for name, tensor in original.items():
        assert name in restored, f"{family.name}: {name} missing after loading"
        assert torch.equal(restored[name], tensor), f"{family.name}: {name} differs after loading"


def assert_generates_as_transformers(loaded: LoadedModel) -> None:
    expected = transformers_greedy(loaded, PROMPT, max_new_tokens=8)
    assert generate(loaded, [PROMPT], GenerationConfig(max_new_tokens=8)).requests[0].token_ids == expected


@pytest.mark.parametrize("family", family_params())
def test_a_transformers_directory_of_every_family_loads_unchanged(family: Family, tmp_path: Path) -> None:
    directory = tmp_path / family.name
    family.build_hf().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    loaded = load_model(str(directory), device=TEST_DEVICE)
    assert loaded.architecture == family.build().architecture
    assert_same_weights(family, loaded)
    assert_generates_as_transformers(loaded)


def _gguf_params() -> list[object]:
    return [p for p in family_params() if p.values[0].name not in GGUF_UNREADABLE]  # type: ignore[union-attr]


@pytest.mark.parametrize("family", _gguf_params())
def test_a_gguf_file_of_every_family_loads_with_the_same_weights(family: Family, tmp_path: Path) -> None:
    path = write_gguf(family.build_hf(), tiny_tokenizer(), tmp_path / f"{family.name}.gguf")
    loaded = load_model(str(path), device=TEST_DEVICE)
    expected = family.build().architecture
    if family.model_type in GGUF_READS_AS:
        assert loaded.architecture.model_type == GGUF_READS_AS[family.model_type]
        assert set(loaded.architecture.sliding_windows) == {None}
    else:
        assert loaded.architecture == expected
    assert_same_weights(family, loaded)
    assert_generates_as_transformers(loaded)


@pytest.mark.parametrize("name", sorted(GGUF_UNREADABLE))
def test_a_gguf_architecture_transformers_cannot_read_is_a_clear_error(name: str, tmp_path: Path) -> None:
    family = family_named(name)
    path = write_gguf(family.build_hf(), tiny_tokenizer(), tmp_path / f"{name}.gguf")
    with pytest.raises(ConfigError, match=r"cannot load .*architecture"):
        load_model(str(path))


def test_a_model_that_needs_its_own_code_is_refused(tmp_path: Path) -> None:
    config = {"model_type": "acme_lm", "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="trust_remote_code"):
        load_model(str(tmp_path))


def test_an_unknown_model_type_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "acme_lm"}))
    with pytest.raises(ConfigError, match="'acme_lm'"):
        load_model(str(tmp_path))


def test_an_unsupported_family_is_refused_before_its_weights_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "num_hidden_layers": 2}))
    with pytest.raises(ConfigError, match="'mamba' is not a decoder-only transformer"):
        load_model(str(tmp_path))


def test_a_prompt_past_the_models_context_is_refused() -> None:
    loaded = family_named("llama-gqa").build()
    too_long = PROMPT * (loaded.architecture.max_context // len(PROMPT) + 1)
    with pytest.raises(ConfigError, match=f"context of {loaded.architecture.max_context} tokens"):
        generate(loaded, [too_long], GenerationConfig(max_new_tokens=4))


def test_ls_lists_each_model_with_architecture_context_and_origin(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--json"]) == 0
    models = {row["name"]: row for row in json.loads(capsys.readouterr().out)["models"]}
    assert set(models) == set(EMBEDDED_MODELS) >= {"smollm2", "gemma3-270m"}
    assert models["gemma3-270m"]["context"] == 32768 and models["smollm2"]["context"] == 8192
    for name, row in models.items():
        assert row["architecture"] and row["source"] and row["install"], name
