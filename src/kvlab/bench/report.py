"""`report.md` and PNG plots from a results folder (re-rendered at any time from the files alone)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlab.bench.likelihood import LIKELIHOOD_KEYS
from kvlab.bench.plots import render_plots
from kvlab.bench.presets import PRESETS
from kvlab.bench.results import load_cell_metrics, model_slug, read_json
from kvlab.errors import ConfigError

REPORT_FILE = "report.md"
# Marks a lossless row's likelihood figures: they are its drafter's cache's, its output being full KV's.
DRAFTER_MARK = " †"


def render_report(out: str | Path) -> Path:
    """Write `report.md` and the plots into the results folder `out`; returns the report's path.

    Raises:
        ConfigError: The folder does not exist or holds no finished cell.
    """
    directory = Path(out).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"results folder not found: {directory}")
    config = read_json(directory / "config.json") or {}
    cells = _in_run_order(load_cell_metrics(directory), config)
    if not cells:
        raise ConfigError(f"no finished benchmark cells in {directory} (run `kvlab bench --out {directory}` first)")
    models = _models_in_order(cells, config)
    lines = _header(directory, config, models)
    if any(cell.get("likelihood") for cell in cells):
        lines += LIKELIHOOD_NOTE
    if len(models) > 1:
        lines += models_side_by_side(cells, models)
    for model in models:
        model_cells = [cell for cell in cells if cell["model"] == model]
        plots = render_plots(model_cells, directory, prefix=f"{model_slug(model)}_", model=model)
        lines += model_section(model, model_cells, [plot.name for plot in plots])
    path = directory / REPORT_FILE
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _models_in_order(cells: list[dict[str, Any]], config: dict[str, Any]) -> list[str]:
    """Models with cells, in the preset's order, then as the last run listed them, then by name.

    Runs of one model each may share a folder (`--model smollm2`, then `--model gemma3-270m`): the
    last run's config names only its own model, the preset names both.
    """
    found = sorted({cell["model"] for cell in cells})
    preset_models = list(PRESETS[config["preset"]].models) if config.get("preset") in PRESETS else []
    order = list(dict.fromkeys([*preset_models, *config.get("models", []), *found]))
    return [model for model in order if model in found]


def _in_run_order(cells: list[dict[str, Any]], config: dict[str, Any]) -> list[dict[str, Any]]:
    """Tasks and methods in the order the run listed them (full KV first), others after, by name."""
    task_order = [spec.get("name") for spec in config.get("tasks", [])]
    method_order = ["full", *(method.get("label") for method in config.get("methods", []))]

    def rank(order: list[Any], name: str) -> tuple[int, str]:
        return (order.index(name) if name in order else len(order), name)

    return sorted(cells, key=lambda c: (rank(task_order, c["task"]), rank(method_order, c["method"])))


def _header(directory: Path, config: dict[str, Any], models: Sequence[str]) -> list[str]:
    """The last run's settings; `models` are those with cells in the folder (runs of one model each may share it)."""
    environment = read_json(directory / "environment.json") or {}
    revision = environment.get("git_revision") or {}
    cpu = environment.get("cpu") or {}
    gpus = ", ".join(gpu["name"] for gpu in environment.get("gpu") or []) or "none"
    packages = environment.get("packages") or {}
    versions = ", ".join(f"{name} {version}" for name, version in packages.items() if version)
    tasks_text = "; ".join(
        f"{spec.get('name')} ({spec.get('context_tokens', 'its own')} context tokens, "
        f"{spec.get('max_new_tokens', 'its default')} new tokens)"
        for spec in config.get("tasks", [])
    )
    ratios = config.get("ratios") or []
    return [
        "# kvlab benchmark report",
        "",
        f"- preset: {config.get('preset', 'unknown')}; models: {', '.join(models)}",
        f"- tasks: {tasks_text or 'unknown'}",
        f"- samples per task: {config.get('samples', '?')}; timing repeats per sample: {config.get('repeats', '?')}"
        + (f"; compression ratios swept: {', '.join(f'{r:g}' for r in ratios)}" if ratios else ""),
        f"- git revision: {revision.get('commit', 'unknown')}"
        + (" (uncommitted changes)" if revision.get("dirty") else ""),
        (
            f"- device: {environment.get('device', '?')}; CPU: {cpu.get('processor', '?')}, "
            f"{cpu.get('usable_cores', '?')} usable cores, {cpu.get('torch_threads', '?')} torch threads; GPU: {gpus}"
        ),
        f"- packages: {versions or 'unknown'}",
        "",
        "Quality is each task's primary metric (mean over samples), scored as the task's `scorer` says. Fidelity",
        "compares each output with the full-KV output of the same sample: `= full` is the share of identical",
        "outputs, `diverges at` the median token index of the first difference. TTFT and decode tokens/s are",
        "medians over samples; the KV bytes ratio is fp16 bytes of the same tokens / bytes the cache stores",
        "(everything counted). A method's `compression_ratio` is the fraction of tokens it removes; the",
        "number in an eviction row's name is that fraction in percent (snapkv-75 removes 75%).",
        "",
    ]


LIKELIHOOD_NOTE = [
    "Likelihood (`--likelihood`): each sample's full-KV output is teacher-forced through the full cache and",
    "through the method's compressed cache (the prompt prefilled and compressed as lossy decoding does, the",
    "output fed as decoding feeds it). KL is the mean per token of KL(full || compressed) of the next-token",
    "distributions, in nats; PPL the perplexity of that output under the compressed cache, PPL full under the",
    "full one; each the mean over samples. Lossless rows score their drafter's cache (their output is full",
    "KV's, KL 0); marked with a dagger.",
    "",
]


def models_side_by_side(cells: Sequence[dict[str, Any]], models: Sequence[str]) -> list[str]:
    """Per method and model: mean quality and mean matched prefix over tasks, median KV bytes ratio."""
    lines = ["## Models side by side", ""]
    header = ["method"] + [f"{model} {figure}" for model in models for figure in ("quality", "fidelity", "KV bytes")]
    lines += _row(header) + [_row(["---"] * len(header))[0]]
    for method in dict.fromkeys(cell["method"] for cell in cells):
        row = [method]
        for model in models:
            mine = [c for c in cells if c["model"] == model and c["method"] == method]
            quality = [c["primary"] for c in mine if c["primary"] is not None]
            matched = [c["fidelity"]["matched_prefix"] for c in mine if c["fidelity"]["matched_prefix"] is not None]
            ratios = sorted(c["system"]["kv_bytes_ratio"] for c in mine)
            row += [
                _number(sum(quality) / len(quality) if quality else None),
                _number(sum(matched) / len(matched) if matched else None, 2),
                _number(ratios[len(ratios) // 2] if ratios else None, 2) + ("x" if ratios else ""),
            ]
        lines += _row(row)
    return lines + [
        "",
        "Quality: mean over tasks of the primary metric; fidelity: mean matched prefix; KV bytes: median.",
        "",
    ]


def model_section(model: str, cells: Sequence[dict[str, Any]], plots: Sequence[str]) -> list[str]:
    """The markdown for one model: summary matrix, one table per task, the plots."""
    lines = [f"## {model}", "", "### Quality per task and method", ""]
    lines += summary_table(cells)
    if any(cell.get("likelihood") for cell in cells):
        lines += ["", "### Likelihood of the full-KV output under each method's cache", "", *likelihood_table(cells)]
    for task in dict.fromkeys(cell["task"] for cell in cells):
        task_cells = [cell for cell in cells if cell["task"] == task]
        lines += ["", *task_table(task_cells)]
        if any(cell.get("per_turn") for cell in task_cells):
            lines += ["", *turn_table(task_cells)]
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


def likelihood_table(cells: Sequence[dict[str, Any]]) -> list[str]:
    """Per method: KL, PPL and PPL full (means over tasks of the cells' means) beside the median KV bytes ratio."""
    header = ["method", "KL (nats/token)", "PPL", "PPL full", "KV bytes ratio", "tasks"]
    lines = _row(header) + [_row(["---"] * len(header))[0]]
    for method in dict.fromkeys(cell["method"] for cell in cells):
        mine = [cell for cell in cells if cell["method"] == method]
        scored = [cell["likelihood"] for cell in mine if cell.get("likelihood")]
        ratios = sorted(cell["system"]["kv_bytes_ratio"] for cell in mine)
        means = [sum(figures[key] for figures in scored) / len(scored) if scored else None for key in LIKELIHOOD_KEYS]
        lines += _row([
            method + (DRAFTER_MARK if scored and scored[0].get("cache") == "drafter" else ""),
            _number(means[0], 4),
            _number(means[1]),
            _number(means[2]),
            _number(ratios[len(ratios) // 2], 2) + "x",
            str(len(scored)),
        ])
    return lines


def task_table(cells: Sequence[dict[str, Any]]) -> list[str]:
    """One task: every method's quality, fidelity and system figures."""
    first = cells[0]
    full = next((cell for cell in cells if cell["kind"] == "full"), None)
    title = f"### {first['task']} — {first['workload']} ({first['primary_metric']}, {first['num_samples']} samples)"
    scored = any(cell.get("likelihood") for cell in cells)
    header = ["method", "quality", "vs full", "= full", "diverges at", *(["KL", "PPL", "PPL full"] if scored else []),
              "TTFT s", "decode tok/s", "KV bytes ratio", "peak KV MiB", "other"]  # fmt: skip
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
            *(_likelihood_figures(cell.get("likelihood")) if scored else []),
            _number(system["ttft_s"], 2),
            _number(system["decode_tokens_per_s"], 1),
            _number(system["kv_bytes_ratio"], 2) + "x",
            _number(system["peak_kv_resident_bytes"] / 2**20, 1),
            _other_figures(cell),
        ])
    if first.get("scorer"):
        lines += ["", f"Scorer: {first['scorer']}."]
    if first.get("skipped_rows"):
        lines += ["", f"{first['skipped_rows']} malformed data row(s) were skipped."]
    return lines


def turn_table(cells: Sequence[dict[str, Any]]) -> list[str]:
    """A shared-context task: quality and matched prefix per turn (the cache was compressed at turn 1)."""
    turns = sorted({int(turn) for cell in cells for turn in cell.get("per_turn") or {}})
    header = ["method", *(f"turn {t} quality" for t in turns), *(f"turn {t} fidelity" for t in turns)]
    lines = [
        f"Per turn ({cells[0]['task']}; fidelity: matched prefix):",
        "",
        *_row(header),
        _row(["---"] * len(header))[0],
    ]
    for cell in cells:
        per_turn = cell.get("per_turn") or {}
        qualities = [_number((per_turn.get(str(t)) or {}).get("quality")) for t in turns]
        fidelities = [_number((per_turn.get(str(t)) or {}).get("matched_prefix"), 2) for t in turns]
        lines += _row([cell["method"], *qualities, *fidelities])
    return lines


def _likelihood_figures(figures: dict[str, Any] | None) -> list[str]:
    """A cell's KL, PPL and PPL full as table entries ("n/a" when not measured; a drafter's KL marked)."""
    if not figures:
        return ["n/a"] * len(LIKELIHOOD_KEYS)
    mark = DRAFTER_MARK if figures.get("cache") == "drafter" else ""
    return [_number(figures["kl"], 4) + mark, _number(figures["ppl"]), _number(figures["ppl_full"])]


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
