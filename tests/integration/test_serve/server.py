"""A `kvlab serve` process for the serve tests: started on a free loopback port, stopped by its own handle."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvlab.cli import main
from tests.helpers import free_port, stop_process, wait_until_healthy


class ServeProcess:
    """`python -m kvlab.cli serve ARGS` on 127.0.0.1, ready once /health answers."""

    def __init__(self, workdir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"serve-{self.port}.log"
        command = [sys.executable, "-m", "kvlab.cli", "serve", "--port", str(self.port), *args]
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        self._wait_until_ready(timeout_s=120)

    def _wait_until_ready(self, timeout_s: float) -> None:
        problem = wait_until_healthy(self.process, self.url, self.log, "kvlab serve", timeout_s, poll_s=0.2)
        if problem is not None:
            self.stop()
            pytest.fail(problem)

    def terminate(self) -> None:
        """SIGTERM, as a process manager stops a server."""
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        stop_process(self.process)  # type: ignore[arg-type]

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def post(
        self, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def metric(self, name: str) -> float:
        """The value of an unlabelled-but-for-model sample in /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        _, text = self.get("/metrics")
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        raise AssertionError(f"{name} is not in /metrics")


def offline_text(*args: str) -> str:
    """The text `kvlab generate ARGS --json` prints (the offline reference)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["generate", *args, "--json"])
    assert code == 0, f"kvlab generate {' '.join(args)} exited {code}"
    return str(json.loads(out.getvalue())["text"])
