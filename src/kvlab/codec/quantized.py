"""Family base of code-lossless codecs: quantize, then code the codes losslessly.

The base quantizes each chunk (keys per channel, values per token; see `quantization`), stores the
zero points and scales as zstd-compressed byte planes, and leaves the coding of the codes to the
subclass (`encode_code_chunks` / `decode_code_chunks`). Decoding returns the dequantized tensor:
it equals `reconstruct(input)` bit for bit, and the codes behind it equal the encoder's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar, Literal

import numpy as np
import torch

from kvlab.codec import layouts
from kvlab.codec.base import (
    ChunkShape,
    Codec,
    Kind,
    check_kind,
    copy_checked,
    target_shape,
    untrusted_payload,
    zstd_compress,
    zstd_decompress,
)
from kvlab.codec.errors import CodecError
from kvlab.codec.framing import chunk_bounds, pack_sections, unpack_sections
from kvlab.errors import ConfigError
from kvlab.quant.groupwise import BITS, QuantizedGroups, dequantize, kv_axis, num_groups, quantize

META_LEVEL = 3


@dataclasses.dataclass
class QuantizedCodec(Codec):
    """Quantize (KIVI grouping) then entropy-code the codes; `lossless = "codes"`."""

    kind: Kind = dataclasses.field(
        default="keys", metadata={"help": "keys (quantized per channel) or values (quantized per token)"}
    )
    bits: Literal[2, 3, 4, 8] = dataclasses.field(default=8, metadata={"help": "bits per code: 2, 3, 4 or 8"})
    group_size: int = dataclasses.field(
        default=128, metadata={"help": "elements per group: tokens for keys, channels of one head for values"}
    )

    lossless = "codes"
    # Whether `iter_token_codes` decodes token by token (the base decodes the whole chunk first).
    decodes_by_token: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_kind(self.kind)
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {list(BITS)}, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {self.group_size}")

    def quantize_chunk(self, chunk: torch.Tensor) -> QuantizedGroups:
        """Codes of one chunk `[lead, t, D]`; zeros and scales in the chunk's dtype."""
        try:
            return quantize(chunk, self.bits, kv_axis(self.kind), self.group_size, meta_dtype=chunk.dtype)
        except ValueError as error:
            raise ConfigError(f"codec {self.name!r}: {error}") from error

    def reconstruct(self, tensor: torch.Tensor) -> torch.Tensor:
        tokens = layouts.as_tokens(tensor.detach().cpu())
        rebuilt = torch.empty_like(tokens)
        for start, end in chunk_bounds(tokens.shape[1], self.chunk_tokens):
            rebuilt[:, start:end] = dequantize(self.quantize_chunk(tokens[:, start:end]), tensor.dtype)
        return rebuilt.reshape(tensor.shape)

    def encode_chunk(self, chunk: torch.Tensor) -> bytes:
        return self.encode_chunks([chunk])[0]

    def decode_chunk(self, payload: bytes | memoryview, shape: ChunkShape, dtype: torch.dtype) -> torch.Tensor:
        return next(iter(self.decode_chunks([payload], [shape], dtype)))

    def decode_chunks_into(self, payloads: Sequence[bytes | memoryview], targets: Sequence[torch.Tensor]) -> None:
        shapes = [target_shape(target) for target in targets]
        dtype = targets[0].dtype if targets else torch.float32
        for chunk, target in zip(self.decode_chunks(payloads, shapes, dtype), targets, strict=True):
            copy_checked(chunk, target)

    def encode_chunks(self, chunks: Sequence[torch.Tensor]) -> list[bytes]:
        quantized = [self.quantize_chunk(chunk) for chunk in chunks]
        code_blobs = self.encode_code_chunks([layouts.to_numpy(q.codes) for q in quantized])
        return [pack_sections([_encode_meta(q), blob]) for q, blob in zip(quantized, code_blobs, strict=True)]

    def decode_chunks(
        self, payloads: Sequence[bytes | memoryview], shapes: Sequence[ChunkShape], dtype: torch.dtype
    ) -> Iterator[torch.Tensor]:
        sections = [unpack_sections(payload, 2) for payload in payloads]
        all_codes = self.decode_code_chunks([meta_and_codes[1] for meta_and_codes in sections], shapes)
        for (meta, _), shape, codes in zip(sections, shapes, all_codes, strict=True):
            if codes.shape != shape or (codes.size and int(codes.max()) >= 1 << self.bits):
                raise CodecError(f"codes of shape {codes.shape} do not fit chunk {shape} at {self.bits} bits")
            zeros, scales = self._decode_meta(meta, shape, dtype)
            quantized = QuantizedGroups(layouts.from_numpy(codes), zeros, scales, self.bits,
                                        kv_axis(self.kind) % 3, self.group_size)
            yield dequantize(quantized, dtype)

    def restore_by_token(
        self, payload: bytes | memoryview, target: torch.Tensor, on_token: Callable[[int], None] | None = None
    ) -> int:
        """Decode one chunk's payload into `target` `[lead, t, D]` a token at a time; the peak buffer in bytes.

        Each token is dequantized and written as soon as its codes are decoded, and `on_token(index)`
        follows, so restoration overlaps decoding. The buffer counted is what this method holds besides
        the payload and the target: the metadata and the codes `iter_token_codes` keeps.

        Raises:
            CodecError: The payload does not decode to exactly the target's shape.
        """
        with untrusted_payload(self.name):
            return self._restore_by_token(payload, target, on_token)

    def _restore_by_token(
        self, payload: bytes | memoryview, target: torch.Tensor, on_token: Callable[[int], None] | None
    ) -> int:
        shape = target_shape(target)
        meta, blob = unpack_sections(payload, 2)
        zeros, scales = self._decode_meta(meta, shape, target.dtype)
        meta_bytes = 2 * zeros.numel() * zeros.element_size()
        peak, count = meta_bytes, 0
        for index, (token_codes, held_bytes) in enumerate(self.iter_token_codes(blob, shape)):
            if index >= shape[1] or token_codes.shape != (shape[0], shape[2]) or \
                    (token_codes.size and int(token_codes.max()) >= 1 << self.bits):
                raise CodecError(f"token {index} decoded to codes that do not fit chunk {shape} at {self.bits} bits")
            target[:, index] = self._dequantize_token(token_codes, zeros, scales, index, target.dtype)
            peak, count = max(peak, meta_bytes + held_bytes), index + 1
            if on_token is not None:
                on_token(index)
        if count != shape[1]:
            raise CodecError(f"chunk decoded to {count} tokens, expected {shape[1]}")
        return peak

    def iter_token_codes(self, blob: bytes | memoryview, shape: ChunkShape) -> Iterator[tuple[np.ndarray, int]]:
        """Each token's `[lead, D]` uint8 codes in order, with the bytes of codes held to produce it.

        The base decodes the whole chunk first; coders that decode token by token override this.
        """
        codes = self.decode_code_chunks([blob], [shape])[0]
        if codes.shape != shape:
            raise CodecError(f"codes of shape {codes.shape} do not fit chunk {shape}")
        for index in range(shape[1]):
            yield codes[:, index], codes.nbytes

    def _dequantize_token(
        self, codes: np.ndarray, zeros: torch.Tensor, scales: torch.Tensor, index: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """`[lead, D]` values of token `index`, bit for bit what dequantizing the whole chunk gives there."""
        axis = kv_axis(self.kind) % 3
        # Keys group tokens: the token's group holds its parameters. Values group channels: one row per token.
        row = index // self.group_size if axis == 1 else index
        quantized = QuantizedGroups(layouts.from_numpy(codes[:, None]), zeros[:, row : row + 1],
                                    scales[:, row : row + 1], self.bits, axis, self.group_size)
        return dequantize(quantized, dtype)[:, 0]

    def encode_code_chunks(self, codes: Sequence[np.ndarray]) -> list[bytes]:
        """Lossless payloads of the uint8 codes `[lead, t, D]` of several chunks."""
        return [self.encode_codes(chunk_codes) for chunk_codes in codes]

    def decode_code_chunks(self, blobs: Sequence[bytes | memoryview], shapes: Sequence[ChunkShape]) -> list[np.ndarray]:
        """Inverse of `encode_code_chunks`."""
        return [self.decode_codes(blob, shape) for blob, shape in zip(blobs, shapes, strict=True)]

    def encode_codes(self, codes: np.ndarray) -> bytes:
        """Lossless payload of one chunk's uint8 codes `[lead, t, D]`."""
        raise NotImplementedError

    def decode_codes(self, blob: bytes | memoryview, shape: ChunkShape) -> np.ndarray:
        """Inverse of `encode_codes`: uint8 codes of `shape`."""
        raise NotImplementedError

    def _decode_meta(self, blob: bytes | memoryview, shape: ChunkShape, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        axis = kv_axis(self.kind) % 3
        meta_shape = list(shape)
        meta_shape[axis] = num_groups(shape[axis], self.group_size)
        count = int(np.prod(meta_shape))
        itemsize = torch.empty(0, dtype=dtype).element_size()
        planes = np.frombuffer(zstd_decompress(blob, 2 * count * itemsize), np.uint8).reshape(itemsize, 2 * count)
        values = layouts.from_integer_view(layouts.join_byte_planes(planes), dtype)
        # numpy, not torch: on small tensors torch's thread pool wake-up cost more than the check.
        checked = layouts.to_numpy(values.float())
        if not (np.isfinite(checked).all() and (checked[count:] >= 0).all()):
            raise CodecError("quantization parameters are not finite non-negative scales")
        return values[:count].reshape(meta_shape), values[count:].reshape(meta_shape)


def _encode_meta(quantized: QuantizedGroups) -> bytes:
    """Zero points then scales, as byte planes of their bits, zstd-compressed."""
    both = torch.cat([quantized.zeros.reshape(-1), quantized.scales.reshape(-1)])
    return zstd_compress(layouts.split_byte_planes(layouts.integer_view(both)).tobytes(), META_LEVEL)
