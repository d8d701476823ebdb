"""The field's client tools (lm-eval, `vllm bench serve`, guidellm), each run from its own venv against a
`kvlab serve` the tests started: where the venvs are, how a client is run, and what the server counted."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.test_serve.server import ServeProcess

ROOT = Path(__file__).resolve().parents[3]
TASKS = Path(__file__).resolve().parent / "tasks"
# Nothing a client runs may reach a hub: models, tokenizers and data sets are local files.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# The main venv's settings must not leak into a client's interpreter.
UNSET = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
ERROR_LINE = re.compile(r"error|failed", re.IGNORECASE)


def client_tests_required() -> bool:
    """Under CI (or KVLAB_CLIENTS=1) a missing client venv fails the tests instead of skipping them."""
    return any(os.environ.get(name, "").lower() in ("1", "true") for name in ("CI", "KVLAB_CLIENTS"))


def client_venv(name: str) -> Path:
    """The venv `make clients-setup` built (its stamp is written last), else skip, or fail under CI."""
    venv = ROOT / name
    if (venv / ".installed").is_file():
        return venv
    message = f"{name} is missing: `make clients-setup` builds the client venvs"
    if client_tests_required():
        pytest.fail(message + " (CI must run the client tests)")
    pytest.skip(message)


def run_client(command: list[str], workdir: Path, log_name: str, timeout_s: float, cwd: Path | None = None) -> str:
    """Run a client to completion (offline, in its own session), fail the test on a non-zero exit.

    Returns the client's output (stdout and stderr together), which is also kept in `workdir/log_name`.
    """
    log = workdir / log_name
    env = {key: value for key, value in os.environ.items() if key not in UNSET}
    env.update(OFFLINE, HF_DATASETS_CACHE=str(workdir / "hf-datasets"), TOKENIZERS_PARALLELISM="false")
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=cwd or workdir, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail(f"{Path(command[0]).name} ran past {timeout_s:.0f} s: {summary(log)}")
    if process.returncode != 0:
        pytest.fail(f"{Path(command[0]).name} exited {process.returncode}: {summary(log)}")
    return log.read_text(errors="replace")


def tail(path: Path, num_chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-num_chars:]


def summary(log: Path) -> str:
    """The first lines of a client's log that name an error (where clients quote the server's reply), then its end."""
    errors = [line[:600] for line in log.read_text(errors="replace").splitlines() if ERROR_LINE.search(line)]
    return "\n".join(errors[:5]) + "\n...\n" + tail(log, 2500)


@dataclass(frozen=True)
class HistogramTotals:
    """A Prometheus histogram's running sum and count, as one scrape of /metrics shows them."""

    total: float
    count: float

    def mean_since(self, before: HistogramTotals) -> float:
        count = self.count - before.count
        assert count > 0, "the histogram counted no observation in between"
        return (self.total - before.total) / count


def histogram(server: ServeProcess, name: str) -> HistogramTotals:
    return HistogramTotals(server.metric(name + "_sum"), server.metric(name + "_count"))


def server_log(server: ServeProcess) -> str:
    return tail(server.log, 3000)
