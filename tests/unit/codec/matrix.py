"""Every registered codec with the parameter sets the tests run; a test fails if a codec is missing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvlab.codec import Codec, create_codec

KINDS = ("keys", "values")

CODEC_MATRIX: dict[str, list[dict[str, Any]]] = {
    "raw": [{}],
    "zstd": [{}],
    "byteplane": [{}, {"order": "channel-major"}, {"center": False}],
    "video": [{"encoder": "ffv1"}, {"encoder": "libx265"}],
    "quant_zstd": [{"kind": kind, "bits": bits} for kind in KINDS for bits in (2, 4, 8)]
    + [{"kind": "keys", "bits": 3, "predict": "token"}, {"kind": "values", "bits": 4, "predict": "token"}],
    "cachegen": [{"kind": kind, "bits": bits} for kind in KINDS for bits in (2, 8)]
    + [{"kind": "keys", "bits": 3, "context": "channel"}],
    "video_codes": [
        {"kind": "keys", "bits": 2, "format": "hevc", "preset": "ultrafast"},
        {"kind": "values", "bits": 8, "format": "hevc"},
        {"kind": "keys", "bits": 3, "format": "ffv1"},
    ],
}


def case_id(name: str, params: dict[str, Any]) -> str:
    return "-".join([name, *(f"{key}={value}" for key, value in sorted(params.items()))])


def matrix_params(lossless: str | None = None) -> list[Any]:
    """pytest params `(name, params)` of the matrix, optionally only codecs of one `lossless` kind."""
    cases = []
    for name, param_sets in CODEC_MATRIX.items():
        for params in param_sets:
            if lossless is None or create_codec(name, **params).lossless == lossless:
                cases.append(pytest.param(name, params, id=case_id(name, params)))
    return cases


def build(name: str, params: dict[str, Any], **extra: Any) -> Codec:
    return create_codec(name, **{**params, **extra})


def random_kv(shape: tuple[int, ...], dtype: torch.dtype = torch.float16, seed: int = 0) -> torch.Tensor:
    """KV-like floats: per-channel scales and an outlier channel, like real keys."""
    generator = torch.Generator().manual_seed(seed)
    channel_scale = torch.rand(shape[-1], generator=generator) * 2 + 0.1 if shape else torch.tensor(1.0)
    tensor = torch.randn(shape, generator=generator) * channel_scale
    if len(shape) and shape[-1] > 3:
        tensor[..., 3] += 20.0
    return tensor.to(dtype)
