"""The test matrix covers the registry, and `kvlab ls` lists every codec."""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main
from kvlab.codec import available_codecs, create_codec
from kvlab.components import COMPONENT_PACKAGES
from kvlab.errors import ConfigError
from tests.unit.codec.matrix import CODEC_MATRIX


def test_every_registered_codec_is_in_the_test_matrix() -> None:
    missing = sorted(set(available_codecs()) - set(CODEC_MATRIX))
    assert not missing, f"add these codecs to tests/unit/codec/matrix.py: {missing}"
    assert sorted(CODEC_MATRIX) == available_codecs()


@pytest.mark.parametrize("name", available_codecs())
def test_every_codec_builds_with_defaults_and_names_its_losslessness(name: str) -> None:
    codec = create_codec(name)
    assert codec.lossless in ("bit-exact", "codes", "lossy")
    assert codec.name == name


def test_ls_lists_every_codec_with_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in listing["codecs"]] == available_codecs()
    byteplane = next(row for row in listing["codecs"] if row["name"] == "byteplane")
    assert {p["name"] for p in byteplane["parameters"]} >= {"chunk_tokens", "order", "level", "center"}


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("nope", {}, "unknown codec 'nope'"),
        ("raw", {"chunk_tokens": 0}, "chunk_tokens must be at least 1"),
        ("zstd", {"level": 0}, "level must be a zstd level"),
        ("byteplane", {"order": "diagonal"}, "must be one of"),
        ("quant_zstd", {"bits": 5}, "must be one of [2, 3, 4, 8]"),
        ("quant_zstd", {"predict": "channel"}, "must be one of ['none', 'token']"),
        ("cachegen", {"context": "token"}, "must be one of ['head', 'channel']"),
        ("video_codes", {"format": "h264"}, "must be one of ['hevc', 'ffv1']"),
        ("video_codes", {"hardware": "always"}, "must be one of ['auto', 'never']"),
        ("quant_zstd", {"kind": "queries"}, "must be one of ['keys', 'values']"),
        ("cachegen", {"group_size": 0}, "group_size must be at least 1"),
        ("video", {"encoder": "h264"}, "must be one of ['ffv1', 'libx265']"),
    ],
)
def test_bad_parameters_are_config_errors_listing_allowed_values(name: str, params: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as error:
        create_codec(name, **params)
    assert message in str(error.value)


def test_loading_components_registers_the_codecs() -> None:
    assert "kvlab.codec" in COMPONENT_PACKAGES
