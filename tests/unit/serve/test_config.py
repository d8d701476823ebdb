"""Server settings: limits are validated, and binding beyond loopback needs an API key."""

from __future__ import annotations

import pytest

from kvlab.cli.serve import ServeCommand, config_from_args
from kvlab.errors import ConfigError
from kvlab.serve.config import ServeConfig, is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"])
def test_loopback_addresses_are_recognised(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.4", "example.org"])
def test_other_addresses_need_an_api_key(host: str) -> None:
    with pytest.raises(ConfigError, match="--api-key"):
        ServeConfig(host=host)
    assert ServeConfig(host=host, api_key="k").host == host


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("max_num_seqs", 0, "max_num_seqs"), ("max_queued_requests", -1, "max_queued_requests"), ("mode", "fast", "mode"),
     ("max_prompt_tokens", 0, "max_prompt_tokens"), ("api_key", "", "empty"), ("port", 70000, "port")],
)
def test_bad_settings_are_refused(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**{field: value})  # type: ignore[arg-type]


def test_flags_become_settings_and_the_key_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    ServeCommand().add_arguments(parser)
    monkeypatch.setenv("KVLAB_API_KEY", "from-env")
    config = config_from_args(parser.parse_args(["--host", "0.0.0.0", "--lossless", "--draft-length", "3", "--drafter-arg", "budget=64"]))
    assert (config.api_key, config.mode, config.num_draft_tokens, config.drafter_args) == ("from-env", "lossless", 3, ("budget=64",))
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        config_from_args(parser.parse_args(["--num-draft-tokens", "0"]))


def test_the_serve_module_loads_without_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvlab.cli.serve; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
