"""Library code runs on the tensors' own device: no numpy round trips, no data-dependent host reads,
and timings that wait for the device.

Three checks. A scan of the compressor and cache sources for `.numpy()` (a device tensor must never
be read back to the host there). Every compressor on the `meta` device: a tensor without data makes
any host read (`.numpy()`, `.item()`, `bool()`, `.tolist()`) fail, so a method that passes never
moves data off its device. And the stopwatch synchronizes the device at both ends. Codecs and the
disk tier are outside the first two: they turn KV into bytes on the host by contract, moving it with
one explicit `.cpu()` (`Codec.encode`) or `.to("cpu")` (the disk tier).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvlab
from kvlab.compress import CompressionContext, compressors, create_compressor
from kvlab.compress.quantization import pack_code_tensor, unpack_code_tensor
from kvlab.quant.packing import pack_codes, unpack_codes
from kvlab.timing import Stopwatch, synchronize
from tests.unit.compress.test_compressors import METHOD_MATRIX

PACKAGE = Path(kvlab.__file__).parent
DEVICE_CODE = ("compress", "cache")

HOST_STORAGE: dict[str, str] = {
    "cache/tier_storage.py": "the disk tier writes host bytes; it moves KV to the CPU explicitly before reading it",
}
"""Modules whose purpose is host storage, with why their `.numpy()` calls are not hidden round trips."""

HOST_READS_ON_META: dict[str, str] = {
}
"""Methods that still read device data on the host, with where; each is a strict expected failure."""


def _numpy_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy"
    ]


@pytest.mark.parametrize("directory", DEVICE_CODE)
def test_compressor_and_cache_code_never_calls_numpy_on_a_tensor(directory: str) -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted((PACKAGE / directory).glob("*.py"))
        if str(path.relative_to(PACKAGE)) not in HOST_STORAGE and (lines := _numpy_calls(path))
    }
    assert not offenders, f".numpy() on tensors that may live on an accelerator (file: lines): {offenders}"


def test_the_scan_finds_a_numpy_call(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(x):\n    return x.detach().numpy()\n")
    assert _numpy_calls(sample) == [2]


def _meta_params() -> list[Any]:
    params = []
    for name in compressors.names():
        marks = [pytest.mark.xfail(strict=True, reason=HOST_READS_ON_META[name])] if name in HOST_READS_ON_META else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


@pytest.mark.parametrize("name", _meta_params())
def test_every_compressor_runs_on_a_device_without_host_reads(name: str) -> None:
    compressor = create_compressor(name, **METHOD_MATRIX[name][1])
    keys, values = torch.randn(2, 2, 40, 16, device="meta").unbind(0)
    queries = torch.randn(4, 40, 16, device="meta")
    compressed = compressor.compress(keys, values, CompressionContext(queries, 0.25, layer_idx=1))
    kept_keys, kept_values = compressed.materialize()
    assert kept_keys.device.type == kept_values.device.type == "meta"
    assert kept_keys.shape[1] == kept_values.shape[1] <= 40


@pytest.mark.parametrize("bits", range(1, 9))
def test_packing_on_the_device_gives_the_bytes_of_the_numpy_packer(bits: int) -> None:
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 37), generator=generator, dtype=torch.uint8)
    packed = pack_code_tensor(codes, bits)
    assert np.array_equal(packed.numpy(), pack_codes(codes.numpy(), bits))
    assert torch.equal(unpack_code_tensor(packed, bits, codes.numel()), codes.reshape(-1))
    assert np.array_equal(unpack_codes(packed.numpy(), bits, codes.numel()), codes.reshape(-1).numpy())


def test_the_meta_check_catches_a_host_read() -> None:
    with pytest.raises(RuntimeError):
        bool(torch.randn(3, device="meta").isfinite().all())


class _RecordingBackend:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def synchronize(self, *args: Any) -> None:
        self.calls.append(args)


def test_the_stopwatch_waits_for_the_device_at_both_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _RecordingBackend()
    monkeypatch.setattr(torch, "cuda", backend)
    watch = Stopwatch("cuda:1")
    watch.elapsed()
    assert backend.calls == [(torch.device("cuda:1"),)] * 2


def test_synchronizing_the_cpu_or_meta_device_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cpu has a synchronize of its own; a backend under each name shows whether one is called.
    backend = _RecordingBackend()
    monkeypatch.setattr(torch, "cpu", backend)
    monkeypatch.setattr(torch, "meta", backend, raising=False)
    for device in ("cpu", "meta", torch.device("cpu", 0)):
        synchronize(device)
        Stopwatch(device).elapsed()
    assert backend.calls == [], f"synchronizing the host devices called a backend: {backend.calls}"


def test_a_device_torch_cannot_synchronize_is_an_error() -> None:
    with pytest.raises(ValueError, match="synchronize"):
        synchronize("hpu")
