"""Benchmark tasks, one per module; importing this package registers them all in `tasks`."""

from kvlab.bench.tasks import (
    bfcl,
    hotpotqa,
    humaneval,
    imdb_fewshot,
    longbench,
    math500,
    multilexsum,
    multiturn_squad,
    niah,
    squad,
    variable_tracking,
    xsum,
)
from kvlab.bench.tasks.base import Sample, Task, TaskData, tasks

__all__ = [
    "Sample",
    "Task",
    "TaskData",
    "bfcl",
    "hotpotqa",
    "humaneval",
    "imdb_fewshot",
    "longbench",
    "math500",
    "multilexsum",
    "multiturn_squad",
    "niah",
    "squad",
    "tasks",
    "variable_tracking",
    "xsum",
]
