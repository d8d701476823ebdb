"""Ratio, speed and error of codecs on real KV: what `kvlab codec bench` reports."""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvlab.cache import FullKVLayer, KVCache, forward
from kvlab.codec.base import Lossless, codecs
from kvlab.codec.layouts import integer_view
from kvlab.data import document_token_ids
from kvlab.models import LoadedModel
from kvlab.timing import Stopwatch

# Calls shorter than this are repeated (up to MAX_REPEATS) and the median is reported.
SHORT_CALL_S = 0.2
MAX_REPEATS = 5


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One row of the table: a codec and its parameters (`kind` is added per tensor)."""

    label: str
    codec: str
    params: dict[str, Any] = dataclasses.field(default_factory=dict)


DEFAULT_CASES: tuple[BenchCase, ...] = (
    BenchCase("raw", "raw"),
    BenchCase("zstd-3 (raw bytes)", "zstd", {"level": 3}),
    BenchCase("byteplane", "byteplane"),
    BenchCase("byteplane channel-major", "byteplane", {"order": "channel-major"}),
    BenchCase("byteplane uncentred", "byteplane", {"center": False}),
    BenchCase("video ffv1", "video", {"encoder": "ffv1"}),
    BenchCase("video x265 lossless", "video", {"encoder": "libx265"}),
    *(BenchCase(f"quant_zstd {bits}-bit", "quant_zstd", {"bits": bits}) for bits in (8, 4, 2)),
    *(BenchCase(f"cachegen {bits}-bit", "cachegen", {"bits": bits}) for bits in (8, 4, 2)),
    *(BenchCase(f"video_codes hevc {bits}-bit", "video_codes", {"bits": bits}) for bits in (8, 4, 2)),
)


@dataclasses.dataclass(frozen=True)
class CodecBenchStats:
    """One codec on keys and values together; ratios count every byte of the frames."""

    label: str
    codec: str
    params: dict[str, Any]
    lossless: Lossless
    verified: bool  # decode equals `reconstruct` bit for bit (the input itself for bit-exact codecs)
    num_values: int
    encoded_bytes: int
    bits_per_value: float
    kv_bytes_ratio: float
    encode_mb_s: float  # MB (1e6 bytes) of fp16 input per second
    decode_mb_s: float
    max_abs_error: float
    rms_error: float  # root mean square of decoded - input over every value


def collect_kv(
    loaded: LoadedModel, num_tokens: int, token_ids: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[L, H_kv, T, D]` (fp16, CPU) of the first `num_tokens` of `token_ids` (default:
    the bundled document's tokens)."""
    ids = document_token_ids(loaded.tokenizer, num_tokens) if token_ids is None else token_ids[:num_tokens]
    num_tokens = len(ids)
    cache = KVCache.allocate(loaded.architecture, 1, num_tokens, loaded.dtype, loaded.device)
    with torch.inference_mode():
        forward(loaded.model, cache, torch.tensor([ids], device=loaded.device), logits_to_keep=1)
    keys, values = [], []
    for layer in cache.layers:
        assert isinstance(layer, FullKVLayer)
        layer_keys, layer_values = layer.stored(0)
        keys.append(layer_keys.to("cpu", torch.float16))
        values.append(layer_values.to("cpu", torch.float16))
    return torch.stack(keys), torch.stack(values)


def bench_codecs(
    keys: torch.Tensor,
    values: torch.Tensor,
    cases: Sequence[BenchCase] = DEFAULT_CASES,
    on_progress: Callable[[str], None] | None = None,
) -> list[CodecBenchStats]:
    """Encode and decode `keys` and `values` with every case; `on_progress(label)` after each case."""
    results = []
    for case in cases:
        results.append(_bench_case(case, keys, values))
        if on_progress is not None:
            on_progress(case.label)
    return results


def _bench_case(case: BenchCase, keys: torch.Tensor, values: torch.Tensor) -> CodecBenchStats:
    encoded_bytes, encode_s, decode_s, max_error, squared_error, verified = 0, 0.0, 0.0, 0.0, 0.0, True
    lossless: Lossless = "lossy"
    for kind, tensor in (("keys", keys), ("values", values)):
        params = dict(case.params)
        if any(p.name == "kind" for p in codecs.parameters(case.codec)):
            params["kind"] = kind
        codec = codecs.create(case.codec, **params)
        lossless = codec.lossless
        data, seconds = _timed(functools.partial(codec.encode, tensor))
        encoded_bytes, encode_s = encoded_bytes + len(data), encode_s + seconds
        decoded, seconds = _timed(functools.partial(codec.decode, data))
        decode_s += seconds
        verified &= bool((integer_view(decoded) == integer_view(codec.reconstruct(tensor))).all())
        if tensor.numel():
            error = decoded.float() - tensor.float()
            max_error = max(max_error, float(error.abs().max()))
            squared_error += float(error.square().sum())
    num_values = keys.numel() + values.numel()
    fp16_mb = 2 * num_values / 1e6
    return CodecBenchStats(
        label=case.label,
        codec=case.codec,
        params=dict(case.params),
        lossless=lossless,
        verified=verified,
        num_values=num_values,
        encoded_bytes=encoded_bytes,
        bits_per_value=8 * encoded_bytes / max(num_values, 1),
        kv_bytes_ratio=2 * num_values / max(encoded_bytes, 1),
        encode_mb_s=fp16_mb / max(encode_s, 1e-9),
        decode_mb_s=fp16_mb / max(decode_s, 1e-9),
        max_abs_error=max_error,
        rms_error=(squared_error / max(num_values, 1)) ** 0.5,
    )


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    """The call's result and its median wall time (repeated while calls are short)."""
    times = []
    while True:
        watch = Stopwatch()
        result = call()
        times.append(watch.elapsed())
        if len(times) >= MAX_REPEATS or sum(times) >= SHORT_CALL_S:
            return result, statistics.median(times)
