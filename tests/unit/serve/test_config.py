"""Server settings: limits are validated, binding beyond loopback needs an API key (from a file or the
environment, never the command line), and the Host names answered follow the bound address."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvlab.cli.serve import ServeCommand, config_from_args
from kvlab.errors import ConfigError
from kvlab.serve.config import AccessPolicy, ServeConfig, is_loopback


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
    argv = ["--host", "0.0.0.0", "--lossless", "--draft-length", "3", "--drafter-arg", "budget=64"]
    config = config_from_args(parser.parse_args(argv))
    settings = (config.api_key, config.mode, config.num_draft_tokens, config.drafter_args)
    assert settings == ("from-env", "lossless", 3, ("budget=64",))
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        config_from_args(parser.parse_args(["--num-draft-tokens", "0"]))


def test_the_serve_module_loads_without_torch() -> None:
    import subprocess
    import sys

    code = "import sys, kvlab.cli.serve; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def parse(*argv: str) -> ServeConfig:
    import argparse

    parser = argparse.ArgumentParser()
    ServeCommand().add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_a_key_on_the_command_line_is_refused_with_what_to_use_instead() -> None:
    with pytest.raises(ConfigError, match="--api-key-file PATH, or set KVLAB_API_KEY") as refused:
        parse("--api-key", "s3cret")
    assert "s3cret" not in str(refused.value)


def test_the_key_file_is_read_and_a_file_others_can_read_is_warned_of(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVLAB_API_KEY", "from-env")
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    key_file.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        assert parse("--api-key-file", str(key_file)).api_key == "from-file"
    assert not caplog.records
    key_file.chmod(0o640)
    with caplog.at_level(logging.WARNING):
        parse("--api-key-file", str(key_file))
    assert "readable by other users" in caplog.text
    key_file.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        parse("--api-key-file", str(key_file))
    with pytest.raises(ConfigError, match="cannot read the API key file"):
        parse("--api-key-file", str(tmp_path / "missing"))


def test_the_key_never_shows_in_the_settings_repr() -> None:
    assert "s3cret" not in repr(ServeConfig(api_key="s3cret"))


def test_allowed_hosts_and_origins_may_be_repeated_or_comma_separated() -> None:
    config = parse("--allowed-hosts", "a.example, b.example:8000", "--allowed-hosts", "c.example",
                   "--allowed-origins", "https://app.example")
    assert config.allowed_hosts == ("a.example", "b.example:8000", "c.example")
    assert config.allowed_origins == ("https://app.example",)


@pytest.mark.parametrize("origin", ["app.example", "https://app.example/path", "ftp://app.example", "https://u@app.example"])
def test_an_origin_that_is_not_scheme_host_port_is_refused(origin: str) -> None:
    with pytest.raises(ConfigError, match="scheme://host"):
        ServeConfig(allowed_origins=(origin,))


@pytest.mark.parametrize(
    ("host", "header", "port", "allowed"),
    [("127.0.0.1", "localhost:8000", 8000, True), ("127.0.0.1", "[::1]:8000", 8000, True),
     ("127.0.0.1", "localhost:8001", 8000, False), ("127.0.0.1", "localhost", 80, True),
     ("127.0.0.1", "evil.example:8000", 8000, False), ("192.168.1.4", "192.168.1.4:8000", 8000, True),
     ("192.168.1.4", "localhost:8000", 8000, False), ("0.0.0.0", "anything.example:1", 8000, True)],
)
def test_the_default_hosts_follow_the_bound_address(host: str, header: str, port: int, allowed: bool) -> None:
    policy = AccessPolicy.of(ServeConfig(host=host, api_key="k"))
    assert policy.allows_host(header, port) is allowed
