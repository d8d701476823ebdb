"""Benchmark: every method on task quality and system cost (design 2 of PAPERS.md).

Tasks (one per module in `kvlab.bench.tasks`, registered in `tasks`) read real data shipped in PyPI
packages; methods (`kvlab.bench.methods`) are full KV, lossy compressors and, once wired, lossless
speculative decoding; `run_benchmark` runs the resumable matrix and `render_report` writes
`report.md` with plots.
"""

from kvlab.bench.config import BenchConfig
from kvlab.bench.methods import CATALOG, BenchMethod, parse_method, run_method
from kvlab.bench.presets import PRESETS, preset_config
from kvlab.bench.runner import BenchCallbacks, run_benchmark
from kvlab.bench.tasks import Sample, Task, TaskData, tasks

__all__ = [
    "CATALOG",
    "PRESETS",
    "BenchCallbacks",
    "BenchConfig",
    "BenchMethod",
    "Sample",
    "Task",
    "TaskData",
    "parse_method",
    "preset_config",
    "run_benchmark",
    "run_method",
    "tasks",
]
