"""The KVCodec frame layout, and the video codec's behaviour without PyAV."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvlab.codec import create_codec
from kvlab.codec.layouts import VideoGeometry, from_video_frames, to_video_frames
from kvlab.errors import ConfigError


@pytest.mark.parametrize(("lead", "channels", "planes"), [(1, 1, 1), (3, 64, 2), (7, 100, 4), (90, 64, 2)])
def test_frames_round_trip_the_planes(lead: int, channels: int, planes: int) -> None:
    data = np.random.default_rng(0).integers(0, 256, (planes, lead, 5, channels), dtype=np.uint8)
    geometry = VideoGeometry(lead, channels, planes)
    frames = to_video_frames(data, geometry)
    assert frames.shape == (5, geometry.height, geometry.width), "one frame per token"
    assert geometry.height % 8 == 0 and geometry.width % 8 == 0
    assert np.array_equal(from_video_frames(frames, geometry), data)


def test_no_8x8_block_mixes_heads_or_planes() -> None:
    lead, channels, planes = 10, 64, 2
    owner = np.zeros((planes, lead, 1, channels), dtype=np.uint8)
    for plane in range(planes):
        for head in range(lead):
            owner[plane, head] = 1 + plane * lead + head
    frame = to_video_frames(owner, VideoGeometry(lead, channels, planes))[0]
    for row in range(0, frame.shape[0], 8):
        for col in range(0, frame.shape[1], 8):
            owners = set(np.unique(frame[row : row + 8, col : col + 8])) - {0}
            assert len(owners) <= 1, f"block at ({row}, {col}) mixes heads/planes {owners}"


@pytest.mark.parametrize("name", ["video", "video_codes"])
def test_missing_pyav_is_a_config_error_naming_the_package(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)
    with pytest.raises(ConfigError, match="pip install 'av"):
        create_codec(name)
