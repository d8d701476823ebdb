"""Model loading and the only architecture-specific knowledge in kvlab."""

from kvlab.models.architecture import ModelArchitecture
from kvlab.models.compiled_forward import forward_kind
from kvlab.models.embedded import DEFAULT_MODEL, EMBEDDED_MODELS
from kvlab.models.identity import model_identity
from kvlab.models.loading import DTYPES, LoadedModel, ModelSettings, load_configured_model, load_model, wrap_model

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "EMBEDDED_MODELS",
    "LoadedModel",
    "ModelArchitecture",
    "ModelSettings",
    "forward_kind",
    "load_configured_model",
    "load_model",
    "model_identity",
    "wrap_model",
]
