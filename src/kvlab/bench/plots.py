"""PNG figures of a benchmark, one set per model.

- quality vs decode throughput (axes from zero; a Pareto front only when at least 3 points are on it);
- quality per task and KV bytes ratio per task (grouped bars; a missing cell is marked "n/a", never a
  zero-height bar);
- with a ratio sweep: quality and fidelity against the KV bytes ratio, one line per method;
- with likelihood figures: rate-distortion, KL(full || compressed) and perplexity against the KV bytes
  ratio, one line (or marker set) per method;
- with shared-context tasks: quality and fidelity per turn (the decline from turn 1 to turn N).

Figures are drawn on `matplotlib.figure.Figure` objects (no pyplot, no global backend state).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError

# A front through fewer non-dominated points says nothing a table does not.
MIN_PARETO_POINTS = 3
KV_BYTES_LABEL = "KV bytes ratio (fp16 bytes of the tokens / bytes stored)"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on both), by x."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((ox >= x and oy >= y) and (ox > x or oy > y) for j, (ox, oy) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def front_to_draw(points: Sequence[tuple[float, float]]) -> list[int]:
    """The Pareto front's indices when it has at least `MIN_PARETO_POINTS` points, else none."""
    front = pareto_front(points)
    return front if len(front) >= MIN_PARETO_POINTS else []


def method_points(cells: Sequence[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per method: (median decode tokens/s over tasks, mean primary quality over its scored tasks)."""
    by_method: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        by_method.setdefault(cell["method"], []).append(cell)
    return {
        method: (
            statistics.median(c["system"]["decode_tokens_per_s"] for c in group),
            statistics.fmean(c["primary"] for c in group if c["primary"] is not None)
            if any(c["primary"] is not None for c in group)
            else 0.0,
        )
        for method, group in by_method.items()
    }


def render_plots(cells: Sequence[dict[str, Any]], directory: Path, prefix: str, model: str = "") -> list[Path]:
    """Write one model's figures; returns their paths."""
    figure_class = _figure_class()
    suffix = f" — {model}" if model else ""
    paths = [
        _scatter(
            figure_class, cells, f"Quality vs decode throughput{suffix}",
            directory / f"{prefix}quality_vs_throughput.png",
        ),
        _grouped_bars(
            figure_class, cells, lambda c: c["primary"],
            "quality (each task's primary metric)", f"Quality per task{suffix}",
            directory / f"{prefix}quality_by_task.png",
        ),
        _grouped_bars(
            figure_class, cells, lambda c: c["system"]["kv_bytes_ratio"],
            KV_BYTES_LABEL, f"KV bytes ratio per task{suffix}", directory / f"{prefix}kv_bytes_ratio.png",
        ),
    ]  # fmt: skip
    if is_ratio_sweep(cells):
        paths.append(
            _curves(
                figure_class,
                cells,
                f"Quality and fidelity vs KV bytes ratio{suffix}",
                directory / f"{prefix}curves.png",
            )
        )
    if any(cell.get("likelihood") and cell["kind"] == "lossy" for cell in cells):
        paths.append(
            _rate_distortion(
                figure_class, cells,
                f"Rate-distortion: KL and perplexity vs KV bytes ratio{suffix}\n"
                "(point labels: % of tokens removed, or bits)",
                directory / f"{prefix}kl_vs_kv_bytes.png",
            )
        )  # fmt: skip
    if any(cell.get("per_turn") for cell in cells):
        paths.append(
            _per_turn(
                figure_class, cells, f"Decline over turns of a shared context{suffix}", directory / f"{prefix}turns.png"
            )
        )
    return paths


def is_ratio_sweep(cells: Sequence[dict[str, Any]]) -> bool:
    """Some compressor was run at 3 or more settings (a curve, not two budgets)."""
    families: dict[str, set[str]] = {}
    for cell in cells:
        if cell["kind"] == "lossy":
            families.setdefault(method_family(cell["method"]), set()).add(cell["method"])
    return any(len(labels) >= 3 for labels in families.values())


def method_family(label: str) -> str:
    """The line a row belongs to in a curve: its label without the trailing setting ("snapkv-87.5" -> "snapkv")."""
    head, _, tail = label.rpartition("-")
    return head if head and tail.replace(".", "", 1).isdigit() else label


def curve_points(
    cells: Sequence[dict[str, Any]], value: Callable[[dict[str, Any]], float | None]
) -> dict[str, list[tuple[float, float]]]:
    """Per family of lossy rows: (median KV bytes ratio over tasks, mean `value` over tasks), by x."""
    return {
        family: [(x, y) for x, y, _ in points] for family, points in labelled_curve_points(cells, value).items()
    }


def labelled_curve_points(
    cells: Sequence[dict[str, Any]], value: Callable[[dict[str, Any]], float | None]
) -> dict[str, list[tuple[float, float, str]]]:
    """`curve_points` with each point's row label: (x, y, label) per family, by x."""
    by_method: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        by_method.setdefault(cell["method"], []).append(cell)
    lines: dict[str, list[tuple[float, float, str]]] = {}
    for method, group in by_method.items():
        values = [v for v in map(value, group) if v is not None]
        if group[0]["kind"] != "lossy" or not values:
            continue
        x = statistics.median(c["system"]["kv_bytes_ratio"] for c in group)
        lines.setdefault(method_family(method), []).append((x, statistics.fmean(values), method))
    return {family: sorted(points) for family, points in lines.items()}


# Height of a scatter plot's axes in points (a 5-inch figure less its margins), for placing labels.
AXES_HEIGHT_PT = 300.0


def label_offsets(
    points: Sequence[tuple[float, float]],
    height_pt: float = AXES_HEIGHT_PT,
    width_frac: float = 0.2,
    gap_pt: float = 10.0,
) -> list[float]:
    """How far up, in points, to lift each point's label so labels of nearby points do not overprint.

    Points are placed on axes that start at zero, `height_pt` tall; a label is `width_frac` of the
    x range wide and one line (`gap_pt`) high. From the lowest point up, each label goes at its point
    or just above every label already placed that it would overlap.
    """
    x_max = max((x for x, _ in points), default=0.0) or 1.0
    y_max = max((y for _, y in points), default=0.0) or 1.0
    placed: list[tuple[float, float]] = []  # (x as a fraction of the range, label height in points)
    offsets = [0.0] * len(points)
    for index in sorted(range(len(points)), key=lambda i: (points[i][1], points[i][0])):
        x, y = points[index][0] / x_max, points[index][1] / y_max * height_pt
        label = y
        for other_x, other_label in sorted(placed, key=lambda item: item[1]):
            if abs(other_x - x) < width_frac and label - gap_pt < other_label < label + gap_pt:
                label = other_label + gap_pt
        placed.append((x, label))
        offsets[index] = label - y
    return offsets


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install matplotlib (or pip install 'kvlab[bench]')") from None
    return Figure


def _scatter(figure_class: Any, cells: Sequence[dict[str, Any]], title: str, path: Path) -> Path:
    points = method_points(cells)
    names = list(points)
    coordinates = [points[name] for name in names]
    figure = figure_class(figsize=(7, 5), layout="constrained")
    axes = figure.subplots()
    axes.scatter([x for x, _ in coordinates], [y for _, y in coordinates], color="tab:blue", zorder=3)
    offsets = label_offsets(coordinates)
    for name, (x, y), lift in zip(names, coordinates, offsets, strict=True):
        leader = {"arrowstyle": "-", "color": "0.6", "linewidth": 0.5} if lift else None
        axes.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4 + lift), fontsize=8, arrowprops=leader)
    front = front_to_draw(coordinates)
    if front:
        xs, ys = [coordinates[i][0] for i in front], [coordinates[i][1] for i in front]
        axes.plot(xs, ys, color="tab:red", linestyle="--", label="Pareto front", zorder=2)
        axes.legend()
    # From zero, so a gap of 0.01 looks like one; tall enough for the lifted labels.
    axes.set_xlim(left=0)
    y_max = max((y for _, y in coordinates), default=0.0) or 1.0
    # A label's top sits its lift plus about two lines (16 points) above its point.
    label_top = max(
        (y + (lift + 16.0) / AXES_HEIGHT_PT * y_max for (_, y), lift in zip(coordinates, offsets, strict=True)),
        default=y_max,
    )
    axes.set_ylim(bottom=0, top=max(1.05 * y_max, label_top))
    axes.set_xlabel("decode throughput, tokens/s (median over tasks)")
    axes.set_ylabel("quality (mean of primary metrics over tasks)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.savefig(path, dpi=120)
    return path


def _grouped_bars(
    figure_class: Any,
    cells: Sequence[dict[str, Any]],
    value: Callable[[dict[str, Any]], float | None],
    ylabel: str,
    title: str,
    path: Path,
) -> Path:
    """One group of bars per task, one bar per method (both in the cells' order), of `value(cell)`."""
    methods = list(dict.fromkeys(cell["method"] for cell in cells))
    task_names = list(dict.fromkeys(cell["task"] for cell in cells))
    lookup = {(cell["task"], cell["method"]): value(cell) for cell in cells}
    figure = figure_class(figsize=(max(7, 1.4 * len(task_names) + 2), 5), layout="constrained")
    axes = figure.subplots()
    width = 0.8 / max(len(methods), 1)
    for offset, method in enumerate(methods):
        xs = [i + (offset - (len(methods) - 1) / 2) * width for i in range(len(task_names))]
        heights = [lookup.get((task, method)) for task in task_names]
        bars = axes.bar(xs, [h or 0.0 for h in heights], width, label=method)
        for x, height, bar in zip(xs, heights, bars, strict=True):
            if height is None:
                bar.set_visible(False)
                axes.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=7, color="dimgray")
    axes.set_xticks(range(len(task_names)), task_names, rotation=20, ha="right")
    axes.set_ylabel(ylabel)
    axes.set_title(
        title
        + (
            "  (n/a: no result for that cell)"
            if None in lookup.values() or len(lookup) < len(methods) * len(task_names)
            else ""
        )
    )
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=7, ncols=min(len(methods), 4))
    figure.savefig(path, dpi=120)
    return path


CURVE_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
CURVE_DASHES = ("-", "--", "-.", ":")


def _curves(figure_class: Any, cells: Sequence[dict[str, Any]], title: str, path: Path) -> Path:
    figure = figure_class(figsize=(12, 5), layout="constrained")
    panels = figure.subplots(1, 2)
    full = [c for c in cells if c["kind"] == "full"]
    full_quality = statistics.fmean(c["primary"] for c in full if c["primary"] is not None) if full else None
    series = (
        (panels[0], lambda c: c["primary"], "quality (mean of primary metrics over tasks)", full_quality),
        (panels[1], lambda c: c["fidelity"]["matched_prefix"], "fidelity (share of the full-KV output matched)", 1.0),
    )
    lossless = sorted({c["method"] for c in cells if c["kind"] == "lossless"})
    for axes, value, ylabel, full_level in series:
        for index, (family, points) in enumerate(curve_points(cells, value).items()):
            # Methods can coincide (CaM and StreamingLLM keep the same tokens): each line gets its own
            # marker and dash, drawn thinner as it goes, so one never hides another.
            axes.plot(
                [x for x, _ in points],
                [y for _, y in points],
                marker=CURVE_MARKERS[index % len(CURVE_MARKERS)],
                linestyle=CURVE_DASHES[index % len(CURVE_DASHES)],
                linewidth=max(3.0 - 0.5 * index, 1.0),
                markersize=max(9.0 - 1.5 * index, 4.0),
                label=family,
            )
        if full_level is not None:
            axes.axhline(full_level, color="black", linewidth=1, label="full KV")
            for name in lossless:
                # Lossless rows reproduce full KV, so they sit on its level whatever their drafter stores.
                axes.axhline(full_level, color="tab:green", linestyle=":", linewidth=2, label=f"{name} (= full)")
        axes.set_xscale("log", base=2)
        axes.set_xlabel(KV_BYTES_LABEL)
        axes.set_ylabel(ylabel)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
    panels[0].legend(fontsize=7)
    figure.suptitle(title)
    figure.savefig(path, dpi=120)
    return path


def _likelihood_value(cell: dict[str, Any], key: str) -> float | None:
    figures = cell.get("likelihood")
    return None if not figures else figures[key]


def _rate_distortion(figure_class: Any, cells: Sequence[dict[str, Any]], title: str, path: Path) -> Path:
    """KL and PPL of the lossy rows against their KV bytes ratio, each point labelled with its row's setting
    (eviction: percent of tokens removed; quantizers: bits); full KV's PPL as a level (its KL is 0)."""
    from matplotlib.ticker import LogFormatter

    figure = figure_class(figsize=(12, 5), layout="constrained")
    panels = figure.subplots(1, 2)
    full = [c["likelihood"]["ppl"] for c in cells if c["kind"] == "full" and c.get("likelihood")]
    full_ppl = statistics.fmean(full) if full else None
    series = (
        (panels[0], "kl", "KL(full || compressed), nats per token (mean over tasks)", None),
        (panels[1], "ppl", "perplexity of the full-KV output (mean over tasks)", full_ppl),
    )
    for axes, key, ylabel, full_level in series:
        lines = labelled_curve_points(cells, functools.partial(_likelihood_value, key=key))
        for index, (family, points) in enumerate(lines.items()):
            xs, ys = [x for x, _, _ in points], [y for _, y, _ in points]
            style = CURVE_DASHES[index % len(CURVE_DASHES)]
            axes.plot(xs, ys, marker=CURVE_MARKERS[index % len(CURVE_MARKERS)], linestyle=style, label=family)
            for x, y, label in points:
                # The row's setting only (snapkv-87.5 -> 87.5): the legend names the method.
                setting = label.removeprefix(family).removeprefix("-")
                axes.annotate(setting, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if full_level is not None:
            axes.axhline(full_level, color="black", linewidth=1, label="full KV")
        if all(y > 0 for points in lines.values() for _, y, _ in points):
            axes.set_yscale("log")  # KL spans decades between a 4-bit quantizer and heavy eviction
        axes.set_xscale("log", base=2)
        for axis in (axes.xaxis, axes.yaxis):
            # Plain numbers, on the minor ticks too when the axis spans under about two decades.
            axis.set_major_formatter(LogFormatter(base=2 if axis is axes.xaxis else 10, labelOnlyBase=False))
            axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        axes.set_xlabel(KV_BYTES_LABEL)
        axes.set_ylabel(ylabel)
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=7)
    figure.suptitle(title)
    figure.savefig(path, dpi=120)
    return path


def _per_turn(figure_class: Any, cells: Sequence[dict[str, Any]], title: str, path: Path) -> Path:
    figure = figure_class(figsize=(12, 5), layout="constrained")
    panels = figure.subplots(1, 2)
    keys = (
        ("quality", "quality (primary metric)"),
        ("matched_prefix", "fidelity (share of the full-KV output matched)"),
    )
    turn_cells = [cell for cell in cells if cell.get("per_turn")]
    several_tasks = len({cell["task"] for cell in turn_cells}) > 1
    for axes, (key, ylabel) in zip(panels, keys, strict=True):
        for cell in turn_cells:
            points = sorted(
                (int(turn), figures[key]) for turn, figures in cell["per_turn"].items() if figures[key] is not None
            )
            label = f"{cell['task']}/{cell['method']}" if several_tasks else cell["method"]
            style = ":" if cell["kind"] == "lossless" else "-"
            axes.plot([t for t, _ in points], [v for _, v in points], style, marker="o", label=label)
        axes.set_xlabel("turn (the cache was compressed at turn 1)")
        axes.set_ylabel(ylabel)
        axes.set_ylim(bottom=0, top=1.05)
        axes.xaxis.get_major_locator().set_params(integer=True)
        axes.grid(alpha=0.3)
    panels[0].legend(fontsize=7)
    figure.suptitle(title)
    figure.savefig(path, dpi=120)
    return path
