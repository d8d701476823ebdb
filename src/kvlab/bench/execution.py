"""Run untrusted generated code in a separate, limited Python process, never in the benchmark's own.

The child runs in isolated mode (`python -I`) in an empty temporary directory with a minimal
environment, its own session (killed as a group on timeout), resource limits on memory, CPU time,
file size and processes, and sockets disabled by a preamble. This is a guard against accidents
(endless loops, memory bombs, stray writes, network calls), not a security boundary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Literal

MEMORY_LIMIT_BYTES = 2 * 2**30
FILE_SIZE_LIMIT_BYTES = 16 * 2**20

NO_NETWORK_PREAMBLE = """\
import socket as _socket


def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the kvlab benchmark sandbox")


_socket.socket = _no_network
_socket.create_connection = _no_network
_socket.getaddrinfo = _no_network
del _socket
"""

ExecutionStatus = Literal["passed", "failed", "timed out"]


@dataclasses.dataclass(frozen=True, slots=True)
class ExecutionResult:
    """Outcome of one program: `passed` when it exited 0 within the time limit."""

    status: ExecutionStatus
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_python(program: str, timeout_s: float = 10.0) -> ExecutionResult:
    """Run `program` in a sandboxed child interpreter; its output is captured and only summarized."""
    with tempfile.TemporaryDirectory(prefix="kvlab-exec-") as workdir:
        script = Path(workdir) / "program.py"
        script.write_text(NO_NETWORK_PREAMBLE + "\n" + program, encoding="utf-8")
        process = subprocess.Popen(
            [sys.executable, "-I", str(script)],
            cwd=workdir,
            env={"PATH": os.defpath, "PYTHONHASHSEED": "0", "HOME": workdir},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_limit_resources(timeout_s),  # limits must be set in the child
        )
        try:
            _, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return ExecutionResult("timed out")
    if process.returncode == 0:
        return ExecutionResult("passed")
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return ExecutionResult("failed", lines[-1][:200] if lines else f"exit code {process.returncode}")


def _limit_resources(timeout_s: float):  # type: ignore[no-untyped-def]
    def apply() -> None:
        import resource

        cpu_seconds = int(timeout_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT_BYTES, FILE_SIZE_LIMIT_BYTES))

    return apply


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
