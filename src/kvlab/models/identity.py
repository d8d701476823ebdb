"""A digest naming exactly which weights, precision and device produce a model's KV.

KV is only reusable by the computation that made it: the same weights, in the same dtype, on the same
kind of device (kernels differ in their last bits across devices). The digest covers the
configuration, every parameter's and buffer's name, shape, dtype and device type, and every byte of
every parameter and buffer (SHA-256), so a change to any one weight gives new store keys.

Hashing every byte costs a fraction of a second per 100M parameters, so digests are cached twice:
with the model object for this process (checked against each parameter's version counter, which any
in-place change bumps), and on disk for a model loaded from a directory, keyed by the configuration,
the layout (version counters included: a model changed in place after loading is hashed afresh) and
the path, size, mtime and inode of every weight file there: a changed checkpoint gives a new key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import weakref
from pathlib import Path

import torch
from transformers import PreTrainedModel

from kvlab.models.packed_linear import packed_weights
from kvlab.paths import cache_dir

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_DIGESTS: weakref.WeakKeyDictionary[PreTrainedModel, tuple[tuple[int, ...], str]] = weakref.WeakKeyDictionary()


def model_identity(model: PreTrainedModel) -> str:
    """Hex SHA-256 of the model's configuration, tensor layout, every weight byte, dtype and device type."""
    tensors = _named_tensors(model)
    versions = tuple(tensor._version for _, tensor in tensors)
    cached = _DIGESTS.get(model)
    if cached is not None and cached[0] == versions:
        return cached[1]
    layout = _layout(model, tensors)
    record = _record_path(layout, versions, _weight_files(model))
    digest = _read_record(record) if record is not None else None
    if digest is None:
        digest = _hash_tensors(layout, tensors)
        if record is not None:
            _write_record(record, digest)
    _DIGESTS[model] = (versions, digest)
    return digest


def identity_cache_dir() -> Path:
    """Where digests of models loaded from directories are kept (one small file each)."""
    return cache_dir() / "identities"


def _named_tensors(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    # Packed linear layers hold their weights outside `named_parameters`; they are hashed under the
    # names an unpacked model gives them, so packing does not change a model's identity.
    named = [
        *model.named_parameters(),
        *packed_weights(model),
        *(("buffer:" + name, buffer) for name, buffer in model.named_buffers()),
    ]
    return sorted(named, key=lambda item: item[0])


def _layout(model: PreTrainedModel, tensors: list[tuple[str, torch.Tensor]]) -> str:
    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # where the files were, not what they are
    entries = [f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type}" for name, tensor in tensors]
    return json.dumps({"config": config, "tensors": entries}, sort_keys=True, default=str)


def _hash_tensors(layout: str, tensors: list[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256(layout.encode())
    with torch.no_grad():
        for _, tensor in tensors:
            if tensor.device.type == "meta":
                continue  # no values to hash; the layout says it is on the meta device
            dense = tensor.to_dense() if tensor.is_mkldnn else tensor  # a packed linear weight
            flat = dense.detach().reshape(-1).contiguous().cpu()
            digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _weight_files(model: PreTrainedModel) -> list[Path]:
    source = getattr(model.config, "_name_or_path", "") or ""
    directory = Path(source)
    if not source or not directory.is_dir():
        return []
    return sorted(path for path in directory.iterdir() if path.suffix in _WEIGHT_SUFFIXES and path.is_file())


def _record_path(layout: str, versions: tuple[int, ...], files: list[Path]) -> Path | None:
    """The cache file of this layout and these weight files (None: no files, nothing to key on)."""
    if not files:
        return None
    key = hashlib.sha256(layout.encode())
    key.update(json.dumps(versions).encode())
    for path in files:
        status = path.stat()
        key.update(f"{path.resolve()}:{status.st_size}:{status.st_mtime_ns}:{status.st_ino}\n".encode())
    return identity_cache_dir() / key.hexdigest()


def _read_record(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text if _DIGEST.fullmatch(text) else None


def _write_record(path: Path, digest: str) -> None:
    """Best effort: a cache that cannot be written only means hashing again next time."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=".identity-", dir=path.parent)
        try:
            with os.fdopen(handle, "w") as file:
                file.write(digest)
            os.replace(staging, path)
        except OSError:
            os.unlink(staging)
            raise
