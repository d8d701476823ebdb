"""What stores say: URLs with every credential masked, the right hint for a TLS failure, a warning for a
store secret file other users may read."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvlab.cli import main
from kvlab.store import StoreUnavailableError, create_store, load_secret, redact_url
from kvlab.store.auth import SECRET_FILE_ENV
from tests.unit.store.servers import PrivateRedis


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://127.0.0.1:6379/0?password=hunter2", "redis://127.0.0.1:6379/0?password=***"),
    ("redis://h/0?timeout=2&password=hunter2&x", "redis://h/0?timeout=2&password=***&x"),
    ("rediss://user:hunter2@h:1/0?ssl_ca_certs=/ca.pem", "rediss://user:***@h:1/0?ssl_ca_certs=/ca.pem"),
    ("redis+cluster://user:hunter2@a:1,b:2?timeout=1", "redis+cluster://user:***@a:1,b:2?timeout=1"),
    ("redis://h/0#hunter2", "redis://h/0#***"),
])
def test_redact_url_masks_query_values_and_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0?password=hunter2", "redis+cluster://127.0.0.1:1?password=hunter2",
                                 "rediss://user:hunter2@127.0.0.1:1/0?timeout=0.2"])
def test_store_cli_errors_never_print_a_password_given_as_an_option(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["store", "stats", url]) in (1, 2)
    captured = capsys.readouterr()
    assert "hunter2" not in captured.out + captured.err, captured.err


def test_a_tls_certificate_failure_says_how_to_fix_tls_not_how_to_start_redis(redis_tls_server: PrivateRedis) -> None:
    files = redis_tls_server.certificates
    url = (f"rediss://127.0.0.1:{redis_tls_server.port}/0?timeout=2&ssl_certfile={files['client.crt']}"
           f"&ssl_keyfile={files['client.key']}")  # no ssl_ca_certs: the system CAs do not know the test CA
    store = create_store(url)
    with pytest.raises(StoreUnavailableError) as raised:
        store.get("k")
    store.close()
    message = str(raised.value)
    assert "TLS handshake failed" in message and "ssl_ca_certs" in message, message
    assert "start it with" not in message and "redis-server --port" not in message, message


def test_a_secret_file_others_may_read_is_used_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kvlab.store.auth"):
        assert load_secret({SECRET_FILE_ENV: str(path)}) == b"0123456789abcdef0123456789abcdef"
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "mode 644" in warnings[0] and "chmod 600" in warnings[0], warnings
    caplog.clear()
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="kvlab.store.auth"):
        load_secret({SECRET_FILE_ENV: str(path)})
    assert not caplog.records, "a private secret file needs no warning"
