"""`video_codes`: quantized KV codes in KVCodec's frame layout, coded by a lossless video encoder."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Literal

import numpy as np

from kvlab.codec import layouts, videoio
from kvlab.codec.base import ChunkShape, codecs, num_elements
from kvlab.codec.errors import CodecError
from kvlab.codec.framing import pack_sections, unpack_sections
from kvlab.codec.quantized import QuantizedCodec
from kvlab.errors import KvlabError

# libav keeps reference frames while decoding HEVC (at most 16 by the standard): counted in the buffer.
MAX_REFERENCE_FRAMES = 16
X265_PRESETS = ("ultrafast", "fast", "medium", "slow")


@codecs.register("video_codes")
@dataclasses.dataclass
class VideoCodesCodec(QuantizedCodec):
    """Code-lossless: KIVI-grouped codes as video frames, coded by lossless HEVC or FFV1.

    Paper: KVCodec (arXiv 2602.09725), its operating point: quantize, then code the codes with H.265
    in lossless mode. Family: code-lossless codecs (`QuantizedCodec`). Layout (`layouts.VideoGeometry`
    with one plane): token t of a chunk is frame t, so the encoder's inter-frame prediction sees each
    token's neighbour; each head's D codes fill their own 8x8-aligned tile, so no coding block mixes
    heads; a code is one 8-bit pixel. Each chunk is its own video and decodes on its own, frame by
    frame (`iter_token_codes`), so a chunk is restored token by token with a buffer of a few frames.
    A chunk's payload: the zstd metadata, then the video's sections behind one byte naming the pixel
    format they were coded in.

    `format` names the bitstream; `hardware="auto"` encodes with NVENC and decodes its streams with
    NVDEC where this machine has them, and falls back to libx265 / libav's decoder otherwise
    (`videoio.select_backend`). With `verify` every chunk is decoded once more while encoding and
    compared code for code (encoders promise lossless modes; this checks the promise).

    Deviations from the paper: the tile layout is fixed (8x8 tiles on a square grid), not chosen by
    the paper's joint optimization; quantization is KIVI's min-max grouping with fp16 metadata coded
    by zstd beside the video; codes are not rescaled to the full 8-bit pixel range (rescaling only
    multiplies residuals, which lossless coding pays for).
    """

    format: Literal["hevc", "ffv1"] = dataclasses.field(
        default="hevc", metadata={"help": "bitstream: hevc (x265 lossless or NVENC) or ffv1"}
    )
    preset: Literal["ultrafast", "fast", "medium", "slow"] = dataclasses.field(
        default="medium", metadata={"help": "x265 speed preset (slower codes smaller; decoding speed is unchanged)"}
    )
    hardware: Literal["auto", "never"] = dataclasses.field(
        default="auto", metadata={"help": "auto: NVENC/NVDEC when this machine has them; never: CPU only"}
    )
    verify: bool = dataclasses.field(
        default=True, metadata={"help": "decode each chunk after encoding it and fail unless the codes match"}
    )

    decodes_by_token = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.format not in videoio.FORMATS:
            raise ValueError(f"format must be one of {list(videoio.FORMATS)}, got {self.format!r}")
        if self.preset not in X265_PRESETS:
            raise ValueError(f"preset must be one of {list(X265_PRESETS)}, got {self.preset!r}")
        if self.hardware not in videoio.HARDWARE:
            raise ValueError(f"hardware must be one of {list(videoio.HARDWARE)}, got {self.hardware!r}")
        videoio.require_av()

    def layout(self) -> str:
        return "kvcodec-code-frames"

    def backend(self) -> videoio.VideoBackend:
        """What encodes on this machine (see `videoio.select_backend`), with this codec's x265 preset."""
        return _with_preset(videoio.select_backend(self.format, self.hardware), self.preset)

    def encode_codes(self, codes: np.ndarray) -> bytes:
        if codes.size == 0:
            return pack_sections([])
        geometry = layouts.VideoGeometry(codes.shape[0], codes.shape[2], 1)
        frames = layouts.to_video_frames(codes[None], geometry)
        backend = self.backend()
        # Measured (PyAV 18, x265 3.x): lossless x265 at preset medium now and then returns one frame
        # with wrong pixels, and not on every run of the same input; a second try, then ultrafast
        # (never seen to fail), recovers. Any decoder reads any preset's stream.
        attempts = [backend, backend, _with_preset(backend, "ultrafast")] if self.verify else [backend]
        for attempt in attempts:
            pixel_format = bytes([videoio.PIXEL_FORMATS.index(attempt.pixel_format)])
            payload = pack_sections([pixel_format, *videoio.encode_frames(frames, attempt)])
            if not self.verify or np.array_equal(self.decode_codes(payload, _shape(codes)), codes):
                return payload
        raise KvlabError(f"{backend.encoder} did not reproduce the codes of a chunk {codes.shape}")

    def decode_codes(self, blob: bytes | memoryview, shape: ChunkShape) -> np.ndarray:
        codes = np.empty(shape, dtype=np.uint8)
        for index, (token_codes, _) in enumerate(self.iter_token_codes(blob, shape)):
            codes[:, index] = token_codes
        return codes

    def iter_token_codes(self, blob: bytes | memoryview, shape: ChunkShape) -> Iterator[tuple[np.ndarray, int]]:
        sections = unpack_sections(blob)
        if num_elements(shape) == 0:
            if sections:
                raise CodecError("an empty chunk carries video data")
            return
        lead, num_tokens, channels = shape
        geometry = layouts.VideoGeometry(lead, channels, 1)
        frame_bytes = geometry.height * geometry.width
        if not sections or len(sections[0]) != 1 or sections[0][0] >= len(videoio.PIXEL_FORMATS):
            raise CodecError("video chunk does not start with a pixel-format section")
        frames = videoio.decode_frames(sections[1:], self.format, (num_tokens, geometry.height, geometry.width),
                                       videoio.PIXEL_FORMATS[sections[0][0]], self.hardware)
        for image in frames:
            token_codes = layouts.from_video_frames(image[None], geometry)[0, :, 0]
            yield token_codes, (MAX_REFERENCE_FRAMES + 1) * frame_bytes + token_codes.nbytes


def _with_preset(backend: videoio.VideoBackend, preset: str) -> videoio.VideoBackend:
    if backend.encoder != "libx265":
        return backend
    options = tuple((key, preset if key == "preset" else value) for key, value in backend.options)
    return dataclasses.replace(backend, options=options)


def _shape(codes: np.ndarray) -> ChunkShape:
    return codes.shape[0], codes.shape[1], codes.shape[2]
