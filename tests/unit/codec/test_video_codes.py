"""The video code codec: identical codes through x265/FFV1, token-by-token restore, backend choice, fuzz."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from kvlab.codec import CodecError, create_codec, videoio
from kvlab.codec.framing import pack_sections, unpack_sections
from kvlab.codec.layouts import as_tokens
from kvlab.codec.quantized import QuantizedCodec
from kvlab.codec.video_codes import VideoCodesCodec
from kvlab.quant.groupwise import dequantize
from tests.unit.codec.matrix import random_kv

SHAPE = (6, 48, 64)


def codes_codec(**params: object) -> VideoCodesCodec:
    codec = create_codec("video_codes", **{"chunk_tokens": 24, "hardware": "never", **params})
    assert isinstance(codec, VideoCodesCodec)
    return codec


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("video_format", ["hevc", "ffv1"])
def test_codes_come_back_identical(bits: int, video_format: str) -> None:
    codec = codes_codec(bits=bits, format=video_format, kind="keys")
    codes = codec.quantize_chunk(as_tokens(random_kv(SHAPE))).codes.numpy()
    decoded = codec.decode_code_chunks(codec.encode_code_chunks([codes]), [codes.shape])[0]
    assert decoded.dtype == np.uint8
    mismatched = np.argwhere(decoded != codes)
    assert mismatched.size == 0, f"{video_format} {bits}-bit: first differing (head, token, channel) {mismatched[:3]}"


@pytest.mark.parametrize("kind", ["keys", "values"])
def test_token_by_token_restore_equals_the_whole_decode(kind: str) -> None:
    codec = codes_codec(bits=4, kind=kind, group_size=16, preset="ultrafast")
    tensor = random_kv(SHAPE)
    data = codec.encode(tensor)
    whole = codec.decode(data)
    payload = codec.encode_chunks([as_tokens(tensor)[:, :24]])[0]
    restored = torch.full((SHAPE[0], 24, SHAPE[2]), float("nan"), dtype=tensor.dtype)
    seen: list[int] = []
    peak = codec.restore_by_token(payload, restored, seen.append)
    assert seen == list(range(24)), "one callback per token, in order"
    assert torch.equal(restored.view(torch.int16), whole[:, :24].view(torch.int16))
    # SmolLM2's geometry (30 layers x 3 heads of 64 channels): a few frames, far below one decoded chunk.
    chunk = as_tokens(random_kv((90, 128, 64), seed=1))
    codec = codes_codec(bits=4, kind=kind, preset="ultrafast")
    peak = codec.restore_by_token(codec.encode_chunk(chunk), torch.empty_like(chunk))
    assert peak < chunk.numel() * chunk.element_size() / 8, f"buffer of {peak} B for a {chunk.numel() * 2} B chunk"


def test_token_by_token_restore_of_the_base_coders_equals_the_whole_decode() -> None:
    codec = create_codec("quant_zstd", bits=2, kind="keys", group_size=8)
    assert isinstance(codec, QuantizedCodec)
    chunk = as_tokens(random_kv((3, 20, 16)))
    payload = codec.encode_chunk(chunk)
    restored = torch.empty_like(chunk)
    codec.restore_by_token(payload, restored)
    assert torch.equal(
        restored.view(torch.int16), codec.decode_chunk(payload, (3, 20, 16), chunk.dtype).view(torch.int16)
    )


def test_hardware_is_chosen_only_when_usable() -> None:
    usable = videoio.select_backend("hevc", "auto", usable=lambda backend: True)
    unusable = videoio.select_backend("hevc", "auto", usable=lambda backend: False)
    forbidden = videoio.select_backend("hevc", "never", usable=lambda backend: True)
    assert (usable.encoder, usable.hardware) == ("hevc_nvenc", True)
    assert unusable.encoder == forbidden.encoder == "libx265"
    assert videoio.select_backend("ffv1", "auto", usable=lambda backend: True).encoder == "ffv1", "no FFV1 hardware"


def test_only_4_4_4_streams_go_to_the_hardware_decoder() -> None:
    assert videoio.decoder_for("hevc", "yuv444p", "auto", usable=lambda backend: True) == "hevc_cuvid"
    assert videoio.decoder_for("hevc", "gray", "auto", usable=lambda backend: True) == "hevc"
    assert videoio.decoder_for("hevc", "yuv444p", "never", usable=lambda backend: True) == "hevc"
    assert videoio.decoder_for("hevc", "yuv444p", "auto", usable=lambda backend: False) == "hevc"


def test_a_machine_without_a_gpu_encodes_on_the_cpu() -> None:
    if videoio.hardware_works(videoio.HARDWARE_BACKENDS["hevc"]):
        pytest.skip("this machine has a working NVENC")
    assert codes_codec(hardware="auto").backend().encoder == "libx265"


def test_the_hardware_pixel_layout_round_trips_on_the_cpu() -> None:
    # NVENC's input (the image as the luma plane of a 4:4:4 frame), coded here by x265.
    backend = dataclasses.replace(videoio.SOFTWARE["hevc"], pixel_format="yuv444p")
    frames = np.random.default_rng(0).integers(0, 16, (5, 64, 64), dtype=np.uint8)
    decoded = np.stack(list(videoio.decode_frames(videoio.encode_frames(frames, backend), "hevc", frames.shape,
                                                  "yuv444p")))
    assert np.array_equal(decoded, frames)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("video_format", ["hevc", "ffv1"])
def test_corrupted_video_payloads_raise_codec_errors_or_decode_to_codes(video_format: str, bits: int) -> None:
    # Past the frame checksums: the decoder itself must fail cleanly on bytes it did not write. At 4 bits
    # most corrupted pixels are not codes (the error half); at 8 bits every pixel is one (the decode half).
    codec = codes_codec(bits=bits, format=video_format, preset="ultrafast")
    chunk = as_tokens(random_kv(SHAPE))[:, :24]
    meta, video = unpack_sections(codec.encode_chunk(chunk), 2)
    # Every value a valid code can decode to under the chunk's (uncorrupted) parameters: [codes, lead, t, D].
    quantized = codec.quantize_chunk(chunk)
    reachable = torch.stack([dequantize(dataclasses.replace(quantized, codes=torch.full_like(quantized.codes, code)),
                                        chunk.dtype) for code in range(1 << codec.bits)])
    rng = random.Random(video_format)
    decoded = 0
    for trial in range(24):
        corrupted = bytearray(video)
        for _ in range(1 + trial % 4):
            corrupted[rng.randrange(len(corrupted))] ^= 1 << rng.randrange(8)
        target = torch.full_like(chunk, float("nan"))
        try:
            codec.restore_by_token(pack_sections([bytes(meta), bytes(corrupted)]), target)
        except CodecError:
            continue
        # Decoded, however wrong the codes: every element written, each the dequantization of some valid code.
        unreachable = (reachable != target).all(dim=0).nonzero()
        assert unreachable.numel() == 0, (
            f"trial {trial}: no {bits}-bit code decodes to the values at (head, token, channel) {unreachable[:3]}")
        decoded += 1
    assert bits < 8 or decoded, "no corrupted 8-bit stream decoded: the decode half went untested"


def test_a_stream_with_missing_frames_is_rejected() -> None:
    codec = codes_codec(bits=4, format="ffv1")
    chunk = as_tokens(random_kv(SHAPE))[:, :24]
    meta, video = unpack_sections(codec.encode_chunk(chunk), 2)
    sections = unpack_sections(video)
    short = pack_sections([bytes(meta), pack_sections([bytes(s) for s in sections[:-3]])])
    with pytest.raises(CodecError, match="frames"):
        codec.decode_chunk(short, (SHAPE[0], 24, SHAPE[2]), chunk.dtype)
