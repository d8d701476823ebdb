"""PNG figures of a benchmark: quality vs throughput with the Pareto front, quality per task, realized ratio.

Figures are drawn on `matplotlib.figure.Figure` objects (no pyplot, no global backend state).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on both), by x."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (ox >= x and oy >= y) and (ox > x or oy > y) for j, (ox, oy) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def method_points(cells: Sequence[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per method: (median decode tokens/s over tasks, mean primary quality over tasks)."""
    by_method: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        by_method.setdefault(cell["method"], []).append(cell)
    return {
        method: (
            statistics.median(c["system"]["decode_tokens_per_s"] for c in group),
            statistics.fmean(c["primary"] or 0.0 for c in group),
        )
        for method, group in by_method.items()
    }


def render_plots(cells: Sequence[dict[str, Any]], directory: Path, prefix: str) -> list[Path]:
    """Write the three figures for one model's cells; returns their paths."""
    figure_class = _figure_class()
    methods = list(dict.fromkeys(cell["method"] for cell in cells))
    task_names = list(dict.fromkeys(cell["task"] for cell in cells))
    paths = [
        _scatter(figure_class, cells, directory / f"{prefix}quality_vs_throughput.png"),
        _grouped_bars(
            figure_class, cells, methods, task_names, lambda c: c["primary"] or 0.0,
            "quality (each task's primary metric)", directory / f"{prefix}quality_by_task.png",
        ),
        _grouped_bars(
            figure_class, cells, methods, task_names, lambda c: c["system"]["kv_bytes_ratio"],
            "realized compression ratio (fp16 bytes / stored bytes)", directory / f"{prefix}realized_ratio.png",
        ),
    ]
    return paths


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install matplotlib (or pip install 'kvlab[bench]')") from None
    return Figure


def _scatter(figure_class: Any, cells: Sequence[dict[str, Any]], path: Path) -> Path:
    points = method_points(cells)
    names = list(points)
    coordinates = [points[name] for name in names]
    figure = figure_class(figsize=(7, 5), layout="constrained")
    axes = figure.subplots()
    axes.scatter([x for x, _ in coordinates], [y for _, y in coordinates], color="tab:blue", zorder=3)
    for name, (x, y) in zip(names, coordinates):
        axes.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto_front(coordinates)
    axes.plot(
        [coordinates[i][0] for i in front], [coordinates[i][1] for i in front],
        color="tab:red", linestyle="--", label="Pareto front", zorder=2,
    )
    axes.set_xlabel("decode throughput, tokens/s (median over tasks)")
    axes.set_ylabel("quality (mean of primary metrics over tasks)")
    axes.set_title("Quality vs throughput")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120)
    return path


def _grouped_bars(
    figure_class: Any,
    cells: Sequence[dict[str, Any]],
    methods: list[str],
    task_names: list[str],
    value: Any,
    ylabel: str,
    path: Path,
) -> Path:
    lookup = {(cell["task"], cell["method"]): value(cell) for cell in cells}
    figure = figure_class(figsize=(max(7, 1.4 * len(task_names) + 2), 5), layout="constrained")
    axes = figure.subplots()
    width = 0.8 / max(len(methods), 1)
    for offset, method in enumerate(methods):
        xs = [i + (offset - (len(methods) - 1) / 2) * width for i in range(len(task_names))]
        axes.bar(xs, [lookup.get((task, method), 0.0) for task in task_names], width, label=method)
    axes.set_xticks(range(len(task_names)), task_names, rotation=20, ha="right")
    axes.set_ylabel(ylabel)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=7, ncols=min(len(methods), 4))
    figure.savefig(path, dpi=120)
    return path
