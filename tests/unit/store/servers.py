"""Private redis-servers for the access tests: a password, a Unix socket, TLS with client certificates."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from tests.helpers import free_port, stop_process


def make_certificates(directory: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is not on PATH; the rediss:// tests make their certificates with it")
    directory.mkdir(parents=True, exist_ok=True)
    files = {name: directory / name for name in ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt",
                                                  "client.key")}
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=directory)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=kvlab-test-ca")
    for role in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{role}.key", "-out", f"{role}.csr",
            "-subj", f"/CN=kvlab-test-{role}")
        run("x509", "-req", "-in", f"{role}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{role}.crt", "-days", "2", "-extfile", "san.ext")
    return files


class PrivateRedis:
    """A redis-server of one test module: optionally with a password, on a Unix socket, or TLS only.

    Attributes:
        url: The kvlab store URL that reaches it (password percent-encoded).
    """

    def __init__(self, workdir: Path, password: str | None = None, unix: bool = False, tls: bool = False) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            pytest.fail("redis-server is not on PATH; run scripts/ensure-redis-server")
        workdir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.port = free_port()
        args = [executable, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)]
        if password is not None:
            args += ["--requirepass", password]
        credentials = "" if password is None else f":{quote(password, safe='')}@"
        client: dict[str, object] = {"password": password, "socket_connect_timeout": 0.5, "socket_timeout": 0.5}
        if unix:
            self.socket = workdir / "redis.sock"
            args += ["--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700"]
            self.url = f"redis+unix://{credentials}{self.socket}?db=0"
            client.update(unix_socket_path=str(self.socket))
        elif tls:
            self.certificates = make_certificates(workdir / "tls")
            files = self.certificates
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(files["server.crt"]),
                     "--tls-key-file", str(files["server.key"]), "--tls-ca-cert-file", str(files["ca.crt"])]
            self.url = (f"rediss://{credentials}127.0.0.1:{self.port}/0?ssl_ca_certs={files['ca.crt']}"
                        f"&ssl_certfile={files['client.crt']}&ssl_keyfile={files['client.key']}")
            client.update(host="127.0.0.1", port=self.port, ssl=True, ssl_ca_certs=str(files["ca.crt"]),
                          ssl_certfile=str(files["client.crt"]), ssl_keyfile=str(files["client.key"]))
        else:
            args += ["--port", str(self.port)]
            self.url = f"redis://{credentials}127.0.0.1:{self.port}/0"
            client.update(host="127.0.0.1", port=self.port)
        self.log = workdir / "redis-server.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        self._client = client
        self._wait(redis.Redis(**client))  # type: ignore[arg-type]

    def flush(self) -> None:
        with redis.Redis(**self._client) as client:  # type: ignore[arg-type]
            client.flushdb()

    def _wait(self, client: redis.Redis, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    if client.ping():
                        return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, FileNotFoundError):
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        pytest.fail(f"redis-server did not start: {self.log.read_text(errors='replace')[-2000:]}")

    def stop(self) -> None:
        stop_process(self.process)
