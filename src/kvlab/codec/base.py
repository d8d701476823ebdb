"""The codec family base: chunking, framing and validation shared by every codec.

A codec is a registered dataclass whose fields are its parameters. Subclasses only turn one chunk
`[lead, t, D]` into bytes and back (`encode_chunk` / `decode_chunk`); the base splits tensors into
token chunks, writes and checks the frame (see `framing`), and turns what decoders raise on malformed
bytes into `CodecError` (`untrusted_payload`); anything else, a kvlab bug or a `MemoryError`, goes on
up as itself.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal

import torch
import zstandard

from kvlab.codec import framing, layouts
from kvlab.codec.errors import CodecError
from kvlab.errors import ConfigError, KvlabError
from kvlab.registry import Registry, to_dict

Lossless = Literal["bit-exact", "codes", "lossy"]
Kind = Literal["keys", "values"]
ChunkShape = tuple[int, int, int]

codecs: Registry[Codec] = Registry("codec")

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# What decoders raise on malformed bytes: numpy on buffers of the wrong size (ValueError), short reads
# (IndexError, EOFError, struct.error), values out of range (OverflowError), and zstd. PyAV's errors
# are recognised by `malformed_input` without importing PyAV (an optional dependency).
MALFORMED_INPUT_ERRORS: tuple[type[Exception], ...] = (
    ValueError, IndexError, EOFError, OverflowError, struct.error, zstandard.ZstdError
)


@dataclasses.dataclass
class Codec(abc.ABC):
    """Family base of KV codecs; `lossless` names what a round trip preserves.

    "bit-exact": the decoded tensor has the input's bits. "codes": the quantized codes come back
    identical and the tensor differs from the input by the quantization error only. "lossy": neither.
    """

    chunk_tokens: int = dataclasses.field(
        default=256, metadata={"help": "tokens per chunk; each chunk decodes on its own"}
    )

    lossless: ClassVar[Lossless]
    registry_name: ClassVar[str]

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, got {self.chunk_tokens}")

    @property
    def name(self) -> str:
        return type(self).registry_name

    def layout(self) -> str:
        """How chunk bytes are arranged (recorded in, and checked against, every frame)."""
        return "token-major"

    def params(self) -> dict[str, Any]:
        """The codec's parameters as written into frames (everything `to_dict` gives but the name).

        Fields marked `omit_default` in their metadata are left out at their default, so frames
        written before such a field existed still match the codec that reads them.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.metadata.get("omit_default")}
        return {
            key: value for key, value in to_dict(self).items()
            if key != "name" and not (key in defaults and value == defaults[key])
        }

    def encode(self, tensor: torch.Tensor) -> bytes:
        """One frame holding `tensor` (any shape; see `layouts.token_geometry`) on the CPU."""
        if tensor.dtype not in FLOAT_DTYPES:
            allowed = ", ".join(str(dtype) for dtype in FLOAT_DTYPES)
            raise ConfigError(f"codec {self.name!r} encodes {allowed}, not {tensor.dtype}")
        tokens = layouts.as_tokens(tensor.detach().cpu())
        bounds = framing.chunk_bounds(tokens.shape[1], self.chunk_tokens)
        payloads = self.encode_chunks([tokens[:, start:end] for start, end in bounds])
        return framing.write_frame(
            self.name, self.layout(), self.params(), tensor.dtype, tuple(tensor.shape), self.chunk_tokens, payloads
        )

    def decode(
        self, data: bytes | bytearray | memoryview, expected: framing.ExpectedFrame | None = None
    ) -> torch.Tensor:
        """The tensor a frame holds; raises `CodecError` for any frame this codec did not write intact.

        Args:
            data: The frame.
            expected: Shape, dtype and size the caller accepts (default: any, up to
                `framing.DEFAULT_MAX_DECODED_BYTES`), checked before the output is allocated.
        """
        header, payloads = framing.read_frame(data)
        self.check_header(header)
        (expected or framing.ExpectedFrame()).check(header)
        decoded = torch.empty(header.shape, dtype=header.dtype)
        tokens = layouts.as_tokens(decoded)
        bounds = framing.chunk_bounds(tokens.shape[1], header.chunk_tokens)
        self.decode_into(payloads, [tokens[:, start:end] for start, end in bounds])
        return decoded

    def decode_into(self, payloads: Sequence[bytes | memoryview], targets: Sequence[torch.Tensor]) -> None:
        """Decode each payload into its target `[lead, t, D]` (a view into the output, of the frame's dtype).

        Raises:
            CodecError: A payload does not decode to exactly its target's shape and dtype.
        """
        with untrusted_payload(self.name):
            self.decode_chunks_into(payloads, targets)

    def reconstruct(self, tensor: torch.Tensor) -> torch.Tensor:
        """What `decode(encode(tensor))` must equal bit for bit (the input itself, for bit-exact codecs)."""
        return tensor

    def check_header(self, header: framing.FrameHeader) -> None:
        """Reject frames written by another codec, with other parameters or another layout."""
        if header.codec != self.name:
            raise CodecError(f"frame holds codec {header.codec!r}, not {self.name!r}")
        if header.params != self.params():
            raise CodecError(f"frame was written with parameters {header.params}, this codec has {self.params()}")
        if header.layout != self.layout():
            raise CodecError(f"frame has layout {header.layout!r}, codec {self.name!r} writes {self.layout()!r}")

    def encode_chunks(self, chunks: Sequence[torch.Tensor]) -> list[bytes]:
        """Payloads of several chunks; codecs that vectorize across chunks override this."""
        return [self.encode_chunk(chunk) for chunk in chunks]

    def decode_chunks_into(self, payloads: Sequence[bytes | memoryview], targets: Sequence[torch.Tensor]) -> None:
        """Decode several chunks into their targets; codecs that vectorize across chunks override this."""
        for payload, target in zip(payloads, targets, strict=True):
            self.decode_chunk_into(payload, target)

    def decode_chunk_into(self, payload: bytes | memoryview, target: torch.Tensor) -> None:
        """Decode one chunk into `target`; codecs that can write in place override this."""
        copy_checked(self.decode_chunk(payload, target_shape(target), target.dtype), target)

    @abc.abstractmethod
    def encode_chunk(self, chunk: torch.Tensor) -> bytes:
        """Payload of one chunk `[lead, t, D]` of a float dtype."""

    @abc.abstractmethod
    def decode_chunk(self, payload: bytes | memoryview, shape: ChunkShape, dtype: torch.dtype) -> torch.Tensor:
        """The chunk `[lead, t, D]` of `dtype` that `payload` holds."""


def malformed_input(error: BaseException) -> bool:
    """Whether `error`, raised while decoding untrusted bytes, says the bytes are malformed.

    Out of memory is not (the machine's state, not the data's); nor are kvlab's own errors other than
    `CodecError` (a `ConfigError` such as a missing PyAV says what to install), nor a `TypeError`,
    `AttributeError` or `AssertionError` (kvlab bugs), nor `KeyboardInterrupt`.
    """
    if isinstance(error, CodecError):
        return True
    if isinstance(error, (MemoryError, KvlabError)):
        return False
    # PyAV is optional: its errors exist only once it is imported, and it raises different types for
    # the same bad packet across versions (InvalidDataError, ArgumentError, PatchWelcomeError...).
    av_error = sys.modules.get("av.error")
    return isinstance(error, MALFORMED_INPUT_ERRORS) or (
        av_error is not None and isinstance(error, av_error.FFmpegError)
    )


@contextlib.contextmanager
def untrusted_payload(codec_name: str) -> Iterator[None]:
    """Decode untrusted bytes in this block: an error that says they are malformed becomes a
    `CodecError` whose `__cause__` is that error; any other error goes on up unchanged."""
    try:
        yield
    except CodecError:
        raise
    except Exception as error:
        if not malformed_input(error):
            raise
        raise CodecError(f"{codec_name} payload does not decode: {type(error).__name__}: {error}") from error


def target_shape(target: torch.Tensor) -> ChunkShape:
    return target.shape[0], target.shape[1], target.shape[2]


def copy_checked(chunk: torch.Tensor, target: torch.Tensor) -> None:
    """Copy a decoded chunk into its target, refusing any other shape or dtype."""
    if chunk.shape != target.shape or chunk.dtype != target.dtype:
        raise CodecError(f"chunk decoded to {tuple(chunk.shape)} {chunk.dtype}, expected {tuple(target.shape)} "
                         f"{target.dtype}")
    target.copy_(chunk)


def chunk_shapes(header: framing.FrameHeader) -> list[ChunkShape]:
    """`[lead, t, D]` of every chunk of a frame."""
    lead, num_tokens, channels = layouts.token_geometry(header.shape)
    return [(lead, end - start, channels) for start, end in framing.chunk_bounds(num_tokens, header.chunk_tokens)]


def check_kind(kind: str) -> None:
    if kind not in ("keys", "values"):
        raise ValueError(f"kind must be one of ['keys', 'values'], got {kind!r}")


def zstd_compress(data: bytes | memoryview, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


def zstd_decompress(data: bytes | memoryview, expected_size: int) -> bytes:
    """Decompress exactly `expected_size` bytes; anything else is a `CodecError`, raised before more is allocated."""
    if expected_size == 0 and len(data) == 0:
        return b""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as error:
        raise CodecError("zstd block has no valid frame header") from error
    # python-zstandard allocates the content size a frame declares and ignores max_output_size then:
    # a 16 KB block may declare gigabytes, so the declaration is checked first.
    if 0 <= declared != expected_size:
        raise CodecError(f"zstd block declares {declared} bytes, expected {expected_size}")
    output = zstandard.ZstdDecompressor().decompress(data, max_output_size=max(expected_size, 1))
    if len(output) != expected_size:
        raise CodecError(f"zstd block holds {len(output)} bytes, expected {expected_size}")
    return output


def check_level(level: int) -> None:
    if not 1 <= level <= 22:
        raise ValueError(f"level must be a zstd level in 1..22, got {level}")


def num_elements(shape: ChunkShape) -> int:
    return math.prod(shape)
