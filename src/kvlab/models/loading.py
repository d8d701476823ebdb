"""Load a causal LM and its tokenizer, fully offline.

A model is named by an embedded alias ("smollm2", the default), a GGUF file, a local directory in
transformers format, or a Hugging Face id already in the local hub cache. GGUF files are converted
once into a float32 safetensors copy under kvlab's cache directory (keyed by the file's sha256), so
later starts take a second instead of half a minute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import transformers
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from kvlab.errors import ConfigError, ModelNotFoundError
from kvlab.models.architecture import ModelArchitecture
from kvlab.models.attention_hook import install_attention
from kvlab.models.compiled_forward import compile_forward as compile_model_forward
from kvlab.models.decoder_forward import fuse_projections
from kvlab.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS, embedded_gguf_path
from kvlab.models.packed_linear import is_packed, pack_linear_layers
from kvlab.paths import cache_dir

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(slots=True)
class LoadedModel:
    """A model ready for kvlab: attention routed through kvlab, tokenizer and geometry attached.

    Attributes:
        name: What the user asked for (alias, path or id).
        source: The file or directory the weights came from.
        model: The transformers model, in eval mode.
        tokenizer: Its tokenizer, with the chat template when the model has one.
        architecture: Attention geometry (`kvlab.models.ModelArchitecture`).
    """

    name: str
    source: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    architecture: ModelArchitecture

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def packed_weights(self) -> bool:
        """Whether the linear layers run through oneDNN-packed weights (`kvlab.models.packed_linear`)."""
        return is_packed(self.model)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every token id that ends generation (generation config and tokenizer together)."""
        ids: set[int] = set()
        configured = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(configured, int):
            ids.add(configured)
        elif configured:
            ids.update(int(i) for i in configured)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def encode_prompt(self, text: str, raw: bool = False) -> list[int]:
        """Token ids the model is fed for `text`.

        Without `raw`, an instruct model's chat template wraps `text` as one user turn and adds the
        assistant header; with `raw` (or a model without a template) the text is tokenized as is.
        """
        if not text.strip():
            raise ConfigError("the prompt is empty; pass some text with --prompt or --prompt-file")
        return prompt_token_ids(self.tokenizer, text, raw)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, text: str, raw: bool = False) -> list[int]:
    """`LoadedModel.encode_prompt` for a tokenizer alone (a process that loads no model: vLLM's)."""
    if raw or not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    encoded: Any = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True)
    # transformers 5 returns a BatchEncoding here; 4.x returned a plain list.
    ids: Any = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]


def load_model(
    name: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    packed_weights: bool = True,
    compile_forward: bool = False,
) -> LoadedModel:
    """Load a model by alias, GGUF file, local directory or locally cached hub id.

    Args:
        name: None or "smollm2" for the embedded default; see `kvlab ls` for other aliases.
        dtype: "float32", "bfloat16" or "float16". kvlab's equality claims (identity compression,
            lossless decoding, prefix reuse, greedy output equal to transformers') are bit-level in
            float32. In bfloat16/float16 logits can differ in their last bits (kernels round partial
            sums differently between call shapes), and lossless decoding's greedy output may differ
            from plain decoding: a verify over k tokens rounds differently from k single steps, and a
            near-tie can flip (kvlab warns once; `LosslessConfig` says more).
        device: A torch device string ("cpu", "cuda", "cuda:1").
        packed_weights: On a CPU in float32 or bfloat16, run the linear layers through oneDNN with
            weights packed once (`kvlab.models.packed_linear`): decode steps read them about 1.7x
            faster, and in the Llama family each layer's q/k/v and gate/up projections are packed as
            one (`kvlab.models.decoder_forward`). Greedy output stays transformers'; logits differ
            from its `F.linear` in their last bits (measured within 3e-6 of the largest logit). An
            output layer tied to the embeddings is packed as a copy (SmolLM2-135M: 113 MB more, Gemma 3
            270M: 671 MB).
            False keeps transformers' own layers, bit-identical to them.
        compile_forward: Run kvlab's forwards as one graph compiled by `torch.compile`
            (`kvlab.models.compiled_forward`: the Llama family; other models keep the eager forward):
            decode steps skip most of their per-operation host work, after 30 to 75 s of compiling on
            the first forward of each weight set. Inductor packs the float weights itself, so
            `packed_weights` is not applied; each layer's projections are still fused.

    Raises:
        ModelNotFoundError: Nothing by that name is available on this machine.
        ConfigError: Unknown dtype or unsupported architecture.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    check_device(device)
    name = name or DEFAULT_MODEL
    directory, gguf_file = _resolve(name)
    if gguf_file is not None:
        directory = _converted_gguf_dir(gguf_file)
    with _quiet_transformers():
        if directory and Path(directory).is_dir():
            ModelArchitecture.from_config(_local_config(Path(directory)))
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=DTYPES[dtype])
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except OSError as error:
            raise ModelNotFoundError(_not_found_message(name)) from error
    return wrap_model(
        model.to(device),
        tokenizer,
        name=name,
        source=str(gguf_file or directory),
        packed_weights=packed_weights,
        compile_forward=compile_forward,
    )


class ModelSettings(Protocol):
    """The model settings `kvlab generate`'s flags and `kvlab serve`'s `ServeConfig` share, by these names."""

    @property
    def model(self) -> str | None: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def unpacked_weights(self) -> bool: ...
    @property
    def compile_forward(self) -> bool: ...


def load_configured_model(settings: ModelSettings) -> LoadedModel:
    """`load_model` as a front door's model settings ask for it."""
    return load_model(
        settings.model,
        dtype=settings.dtype,
        device=settings.device,
        packed_weights=not settings.unpacked_weights,
        compile_forward=settings.compile_forward,
    )


def check_device(device: str) -> None:
    """Refuse a device string torch cannot parse or this machine does not have, before any loading.

    Raises:
        ConfigError: Naming the device and what is available.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(
                f"device {device!r}: this machine has no CUDA device (torch {torch.__version__}); use --device cpu"
            )
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(f"device {device!r}: only {count} CUDA device(s) here (cuda:0 to cuda:{count - 1})")
    elif parsed.type not in ("cpu", "meta"):
        available = getattr(torch, parsed.type, None)
        if available is None or not getattr(available, "is_available", lambda: False)():
            raise ConfigError(f"device {device!r} is not available on this machine; use --device cpu")


def wrap_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    name: str = "custom",
    source: str = "",
    packed_weights: bool = False,
    compile_forward: bool = False,
) -> LoadedModel:
    """Prepare a model object you already hold for kvlab (eval mode, attention routed to kvlab).

    The model keeps working with plain transformers calls: kvlab only takes over attention in
    forwards that pass a kvlab cache step. With `packed_weights` its linear layers are replaced, in
    place, by oneDNN-packed ones where the device and dtype allow (see `load_model`); with
    `compile_forward` its forwards run one compiled graph where its family allows (see `load_model`).
    """
    model.eval()
    install_attention(model)
    if packed_weights and not compile_forward:  # a compiled graph packs its weights itself
        pack_linear_layers(model)
    if packed_weights or compile_forward:
        fuse_projections(model)
    if compile_forward:
        compile_model_forward(model)
    return LoadedModel(
        name=name,
        source=source,
        model=model,
        tokenizer=tokenizer,
        architecture=ModelArchitecture.from_config(model.config),
    )


def _resolve(name: str) -> tuple[str, Path | None]:
    """(directory or hub id, GGUF file or None) for a model name."""
    if name in EMBEDDED_MODELS:
        return "", embedded_gguf_path(name, cache_dir())
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"{name} is a file but not a .gguf model; pass a .gguf file or a model directory")
        return "", path
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path), None
        gguf_files = sorted(path.glob("*.gguf"))
        if len(gguf_files) == 1:
            return "", gguf_files[0]
        raise ModelNotFoundError(f"{name} holds neither config.json nor exactly one .gguf file")
    if name.endswith(".gguf") or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelNotFoundError(f"no such model file or directory: {name}")
    return name, None


def _local_config(directory: Path) -> PretrainedConfig:
    """The config of a local model directory, refusing models that need their own Python code."""
    raw = json.loads((directory / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        needs_code = "auto_map" in raw
        raise ConfigError(
            f"{directory} holds a model of type {model_type!r} that transformers {transformers.__version__} does not "
            + (
                "implement: it needs its own Python code (trust_remote_code), which kvlab never runs"
                if needs_code
                else "know; kvlab loads only model types transformers implements"
            )
        )
    return AutoConfig.from_pretrained(directory, local_files_only=True)


def _not_found_message(name: str) -> str:
    aliases = ", ".join(EMBEDDED_MODELS)
    return (
        f"model {name!r} is not available locally and kvlab never downloads; pass an embedded alias ({aliases}), "
        "a .gguf file, or a local directory with config.json (e.g. one made by `huggingface-cli download` "
        "on a machine with network access)"
    )


def _converted_gguf_dir(gguf_file: Path) -> str:
    """Directory of the float32 safetensors copy of a GGUF file, converting it on first use."""
    target = cache_dir() / "models" / _sha256(gguf_file)[:24]
    if (target / "config.json").is_file():
        return str(target)
    logger.info("converting %s once into %s (later loads are fast)", gguf_file, target)
    with _quiet_transformers():
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name, local_files_only=True
            )
        except (ValueError, NotImplementedError) as error:
            # transformers names the GGUF architecture it cannot read ("... architecture olmo2 is not supported").
            raise ConfigError(
                f"transformers {transformers.__version__} cannot load {gguf_file}: {str(error).rstrip('.')}; "
                "pass a transformers model directory of the same model instead"
            ) from None
        ModelArchitecture.from_config(model.config)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, local_files_only=True)
        # transformers refuses to save a GGUF-loaded model while it still carries the GGUF quantizer, although
        # the weights are already dequantized to float32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            os.replace(staging, target)
        except OSError:
            # Another process finished the same conversion first; its copy is identical.
            if not (target / "config.json").is_file():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 23), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' own progress bars and info logs while kvlab loads (the library never prints)."""
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # The GGUF converter draws a bare tqdm bar on stderr, whatever transformers' progress-bar setting.
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
