"""`report.md` and PNG plots from a results folder (re-rendered at any time from the files alone)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlab.bench.plots import render_plots
from kvlab.bench.results import load_cell_metrics, model_slug, read_json
from kvlab.errors import ConfigError

REPORT_FILE = "report.md"


def render_report(out: str | Path) -> Path:
    """Write `report.md` and the plots into the results folder `out`; returns the report's path.

    Raises:
        ConfigError: The folder does not exist or holds no finished cell.
    """
    directory = Path(out).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"results folder not found: {directory}")
    cells = _in_run_order(load_cell_metrics(directory), read_json(directory / "config.json") or {})
    if not cells:
        raise ConfigError(f"no finished benchmark cells in {directory} (run `kvlab bench --out {directory}` first)")
    lines = _header(directory)
    for model in dict.fromkeys(cell["model"] for cell in cells):
        model_cells = [cell for cell in cells if cell["model"] == model]
        plots = render_plots(model_cells, directory, prefix=f"{model_slug(model)}_")
        lines += model_section(model, model_cells, [plot.name for plot in plots])
    path = directory / REPORT_FILE
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _in_run_order(cells: list[dict[str, Any]], config: dict[str, Any]) -> list[dict[str, Any]]:
    """Tasks and methods in the order the run listed them (full KV first), others after, by name."""
    task_order = [spec.get("name") for spec in config.get("tasks", [])]
    method_order = ["full", *(method.get("label") for method in config.get("methods", []))]

    def rank(order: list[Any], name: str) -> tuple[int, str]:
        return (order.index(name) if name in order else len(order), name)

    return sorted(cells, key=lambda c: (rank(task_order, c["task"]), rank(method_order, c["method"])))


def _header(directory: Path) -> list[str]:
    environment = read_json(directory / "environment.json") or {}
    config = read_json(directory / "config.json") or {}
    revision = environment.get("git_revision") or {}
    cpu = environment.get("cpu") or {}
    gpus = ", ".join(gpu["name"] for gpu in environment.get("gpu") or []) or "none"
    packages = environment.get("packages") or {}
    versions = ", ".join(f"{name} {version}" for name, version in packages.items() if version)
    return [
        "# kvlab benchmark report",
        "",
        f"- git revision: {revision.get('commit', 'unknown')}{' (uncommitted changes)' if revision.get('dirty') else ''}",
        (
            f"- device: {environment.get('device', '?')}; CPU: {cpu.get('processor', '?')}, "
            f"{cpu.get('usable_cores', '?')} usable cores, {cpu.get('torch_threads', '?')} torch threads; GPU: {gpus}"
        ),
        f"- packages: {versions or 'unknown'}",
        f"- samples per task: {config.get('samples', '?')}; timing repeats per sample: {config.get('repeats', '?')}",
        "",
        "Quality is each task's primary metric (mean over samples). Fidelity compares each output with the",
        "full-KV output of the same sample: `= full` is the share of identical outputs, `diverges at` the median",
        "token index of the first difference. TTFT, decode tokens/s and the realized ratio (fp16 bytes of the",
        "same tokens / bytes stored, everything counted) are medians over samples.",
        "",
    ]


def model_section(model: str, cells: Sequence[dict[str, Any]], plots: Sequence[str]) -> list[str]:
    """The markdown for one model: summary matrix, one table per task, the plots."""
    lines = [f"## {model}", "", "### Quality per task and method", ""]
    lines += summary_table(cells)
    for task in dict.fromkeys(cell["task"] for cell in cells):
        lines += ["", *task_table([cell for cell in cells if cell["task"] == task])]
    lines += ["", "### Plots", ""]
    lines += [f"![{name.removesuffix('.png')}]({name})" for name in plots]
    return lines + [""]


def summary_table(cells: Sequence[dict[str, Any]]) -> list[str]:
    """Methods x tasks matrix of the primary metric, with the mean over tasks."""
    task_names = list(dict.fromkeys(cell["task"] for cell in cells))
    metric_of = {cell["task"]: cell["primary_metric"] for cell in cells}
    lookup = {(cell["method"], cell["task"]): cell["primary"] for cell in cells}
    header = ["method", *(f"{task} ({metric_of[task]})" for task in task_names), "mean"]
    lines = _row(header) + [_row(["---"] * len(header))[0]]
    for method in dict.fromkeys(cell["method"] for cell in cells):
        values = [lookup.get((method, task)) for task in task_names]
        present = [v for v in values if v is not None]
        mean = sum(present) / len(present) if present else None
        lines += _row([method, *(_number(v) for v in values), _number(mean)])
    return lines


def task_table(cells: Sequence[dict[str, Any]]) -> list[str]:
    """One task: every method's quality, fidelity and system figures."""
    first = cells[0]
    full = next((cell for cell in cells if cell["kind"] == "full"), None)
    title = f"### {first['task']} — {first['workload']} ({first['primary_metric']}, {first['num_samples']} samples)"
    header = ["method", "quality", "vs full", "= full", "diverges at", "TTFT s", "decode tok/s", "realized ratio",
              "peak KV MiB", "other"]  # fmt: skip
    lines = [title, "", *_row(header), _row(["---"] * len(header))[0]]
    for cell in cells:
        fidelity, system = cell["fidelity"], cell["system"]
        delta = None
        if full is not None and cell is not full and full["primary"] and cell["primary"] is not None:
            delta = f"{100 * (cell['primary'] / full['primary'] - 1):+.0f}%"
        lines += _row([
            cell["method"],
            _number(cell["primary"]),
            delta or "",
            _number(fidelity["output_exact_match"]),
            "" if fidelity["first_divergence_median"] is None else f"{fidelity['first_divergence_median']:g}",
            _number(system["ttft_s"], 2),
            _number(system["decode_tokens_per_s"], 1),
            _number(system["kv_bytes_ratio"], 2) + "x",
            _number(system["peak_kv_resident_bytes"] / 2**20, 1),
            _other_figures(cell),
        ])
    if first.get("skipped_rows"):
        lines += ["", f"{first['skipped_rows']} malformed data row(s) were skipped."]
    return lines


def _other_figures(cell: dict[str, Any]) -> str:
    """Secondary scores (syntax validity, ...) and a lossless method's acceptance length."""
    figures = [f"{key} {value:.3f}" for key, value in cell["quality"].items() if key != cell["primary_metric"]]
    acceptance = cell["system"].get("acceptance_length")
    if acceptance is not None:
        figures.append(f"acceptance length {acceptance:.1f}")
    return ", ".join(figures)


def _row(values: Sequence[str]) -> list[str]:
    return ["| " + " | ".join(values) + " |"]


def _number(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
