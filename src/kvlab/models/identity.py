"""A digest naming exactly which weights, precision and device produce a model's KV.

KV is only reusable by the computation that made it: the same weights, in the same dtype, on the same
kind of device (kernels differ in their last bits across devices). Hashing every weight byte of a
large model on each start would be slow, so the digest covers the configuration, every parameter's
name, shape and dtype, and a fixed sample of each parameter's values (its first and last elements and
a strided subset).
"""

from __future__ import annotations

import hashlib
import json
import weakref

import torch
from transformers import PreTrainedModel

_SAMPLES_PER_PARAMETER = 4096
_DIGESTS: weakref.WeakKeyDictionary[PreTrainedModel, str] = weakref.WeakKeyDictionary()


def model_identity(model: PreTrainedModel) -> str:
    """Hex SHA-256 of the model's configuration, parameter layout and sampled values, dtype and device type."""
    cached = _DIGESTS.get(model)
    if cached is not None:
        return cached
    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # where the files were, not what they are
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters(), key=lambda item: item[0]):
            flat = parameter.detach().reshape(-1)
            stride = max(1, flat.numel() // _SAMPLES_PER_PARAMETER)
            sample = torch.cat([flat[:64], flat[::stride], flat[-64:]]).float().cpu().contiguous()
            digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype}:{parameter.device.type}".encode())
            digest.update(sample.numpy().tobytes())
    _DIGESTS[model] = digest.hexdigest()
    return _DIGESTS[model]
