"""Redis with a password (holding @ : / #), TLS and Unix sockets; no password is ever printed."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import pytest

from kvlab.cli import main
from kvlab.store import StoreUnavailableError, create_store, redact_url
from kvlab.store.backends.redis import RedisStore
from tests.unit.store.servers import PrivateRedis

PASSWORD = "p@ss:w/rd#1?x"
FORMS = (PASSWORD, quote(PASSWORD, safe=""), "rd#1", "p%40ss")


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory: pytest.TempPathFactory) -> PrivateRedis:
    server = PrivateRedis(tmp_path_factory.mktemp("redis-pass"), password=PASSWORD)
    yield server  # type: ignore[misc]
    server.stop()


def assert_no_password(*texts: str) -> None:
    for text in texts:
        for form in FORMS:
            assert form not in text, f"password form {form!r} printed in {text!r}"


def test_percent_encoded_password_authenticates(locked_server: PrivateRedis) -> None:
    store = create_store(locked_server.url)
    store.put("k", b"v")
    assert store.get("k") == b"v"
    assert_no_password(store.url)
    store.close()


def test_store_cli_never_prints_the_password(
    locked_server: PrivateRedis, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "v.bin"
    source.write_bytes(b"1234")
    url = locked_server.url
    assert main(["store", "put", url, "key-1", str(source)]) == 0
    put = capsys.readouterr()
    assert main(["store", "ls", url, "--json"]) == 0
    listing = capsys.readouterr()
    assert "key-1" in [row["key"] for row in json.loads(listing.out)["keys"]]
    assert json.loads(listing.out)["url"] == redact_url(url)
    assert main(["store", "stats", url, "--json"]) == 0
    stats = capsys.readouterr()
    assert json.loads(stats.out)["url"] == redact_url(url)
    assert main(["store", "stats", url]) == 0
    assert main(["store", "get", url, "absent"]) == 1
    captured = capsys.readouterr()
    assert_no_password(put.out, put.err, listing.out, listing.err, stats.out, stats.err, captured.out, captured.err)


@pytest.mark.parametrize("wrong", ["redis://:wrong@127.0.0.1:{port}/0", "redis://127.0.0.1:{port}/0"])
def test_a_wrong_or_missing_password_exits_1_without_printing_it(
    locked_server: PrivateRedis, wrong: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["store", "stats", wrong.format(port=locked_server.port)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("authentication" in err.lower() or "auth" in err.lower()), err
    assert "wrong" not in err
    assert_no_password(err)


def test_an_unencoded_password_is_a_usage_error_that_does_not_print_it(
    locked_server: PrivateRedis, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["store", "stats", f"redis://:{PASSWORD}@127.0.0.1:{locked_server.port}/0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "percent-encode" in err, err
    assert_no_password(err)


def test_the_password_may_come_from_the_environment(
    locked_server: PrivateRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLAB_REDIS_PASSWORD", PASSWORD)
    store = create_store(f"redis://127.0.0.1:{locked_server.port}/0")
    store.put("from-env", b"ok")
    assert store.get("from-env") == b"ok"
    store.close()


def test_rediss_with_a_client_certificate_round_trips(rediss_url: str) -> None:
    store = create_store(rediss_url)
    assert isinstance(store, RedisStore)
    store.put("over-tls", b"secret kv")
    assert store.get("over-tls") == b"secret kv"
    store.close()


def test_rediss_without_the_ca_is_refused(redis_tls_server: PrivateRedis) -> None:
    """The server's certificate is checked: the system CAs do not know the test CA."""
    files = redis_tls_server.certificates
    url = (f"rediss://127.0.0.1:{redis_tls_server.port}/0?timeout=2&ssl_certfile={files['client.crt']}"
           f"&ssl_keyfile={files['client.key']}")
    store = create_store(url)
    with pytest.raises(StoreUnavailableError):
        store.get("k")
    store.close()


@pytest.mark.parametrize(("url", "message"), [
    ("rediss://h/0?ssl_ca_certs=/nonexistent.pem", "not found"),
    ("rediss://h/0?ssl_certfile={file}", "needs both"),
    ("redis://h/0?ssl_ca_certs={file}", "unknown option 'ssl_ca_certs'"),
    ("redis+unix://?db=0", "socket path"),
    ("redis+unix:///tmp/r.sock?db=x", "database number"),
])
def test_bad_tls_and_socket_urls_are_config_errors(url: str, message: str, tmp_path: Path) -> None:
    from kvlab.errors import ConfigError

    (tmp_path / "a.pem").write_text("x")
    with pytest.raises(ConfigError, match=message):
        create_store(url.format(file=tmp_path / "a.pem"))


def test_unix_socket_store_round_trips(redis_unix_url: str) -> None:
    store = create_store(redis_unix_url)
    store.put("local", b"bytes")
    assert store.get("local") == b"bytes" and store.keys() == ["local"]
    store.close()


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:p@ss:w/rd#1@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
    ("redis://user:p%40ss@h:1/0", "redis://user:***@h:1/0"),
    ("redis://onlyname@h/0", "redis://***@h/0"),
    ("file:///tmp/a@b/store", "file:///tmp/a@b/store"),
    ("redis://h:1/0?timeout=2", "redis://h:1/0?timeout=2"),
])
def test_redact_url_masks_every_credential(url: str, shown: str) -> None:
    assert redact_url(url) == shown
