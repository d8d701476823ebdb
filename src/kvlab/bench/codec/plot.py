"""The rate-fidelity figure: reconstruction error and task fidelity against bits per value.

Drawn on a `matplotlib.figure.Figure` (no pyplot, no global backend state).
"""

from __future__ import annotations

from pathlib import Path

from kvlab.bench.codec.fidelity import PAPER_BITS_PER_VALUE, RateFidelityReport, code_bits

MARKERS = {"quant_zstd": "o", "cachegen": "s", "video_codes": "^"}


def coder_family(label: str) -> str:
    """A rate row's coder without its bit width ("video_codes hevc 4-bit" -> "video_codes hevc")."""
    return label.rsplit(" ", 1)[0]


def save_rate_fidelity_plot(report: RateFidelityReport, path: Path, title: str) -> Path:
    """Write the figure to `path` (PNG) and return it."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.8), layout="constrained")
    rate_axes, task_axes = figure.subplots(1, 2)
    families = sorted({coder_family(row.label) for row in report.rates})
    for family in families:
        rows = sorted((row for row in report.rates if coder_family(row.label) == family), key=code_bits)
        rate_axes.plot([row.bits_per_value for row in rows], [row.rms_error for row in rows],
                       marker=MARKERS.get(rows[0].codec, "x"), label=family, alpha=0.8)
    for bits in sorted({code_bits(row) for row in report.rates}):
        group = [row for row in report.rates if code_bits(row) == bits]
        left = min(group, key=lambda row: row.bits_per_value)
        rate_axes.annotate(f"{bits}-bit codes", (left.bits_per_value, left.rms_error), fontsize=8,
                           xytext=(-10, 8), textcoords="offset points", ha="right")
    bound_x = [bound.best_bits_per_value for bound in report.bounds]
    for axes in (rate_axes, task_axes):
        axes.axvline(PAPER_BITS_PER_VALUE, color="crimson", linestyle="--", linewidth=1)
        axes.set_xlim(0, max([*bound_x, *(row.bits_per_value for row in report.rates), 2.0]) * 1.05)
        axes.set_xlabel("bits per value (metadata included)")
        axes.grid(alpha=0.3)
    rate_axes.text(PAPER_BITS_PER_VALUE, 0.5, " KVCodec: 1.3 bits/value", color="crimson", fontsize=8,
                   rotation=90, va="center", transform=rate_axes.get_xaxis_transform())
    rate_axes.scatter(bound_x, [0.0] * len(bound_x), marker="|", s=200, color="black",
                      label="entropy bound per channel (any order-0 coder)")
    rate_axes.set_ylim(bottom=0)
    rate_axes.set_ylabel("RMS reconstruction error")
    rate_axes.set_title("Rate against reconstruction error, per coder and bit width")
    rate_axes.legend(fontsize=7)
    _task_panel(task_axes, report)
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def _task_panel(axes: object, report: RateFidelityReport) -> None:
    from matplotlib.axes import Axes

    assert isinstance(axes, Axes)
    best: dict[int, float] = {}
    for row in report.rates:
        bits = code_bits(row)
        best[bits] = min(best.get(bits, float("inf")), row.bits_per_value)
    if not report.fidelity:
        axes.text(0.5, 0.5, "task fidelity not measured", ha="center", va="center", transform=axes.transAxes)
    points = [(best[f.bits], f) for f in report.fidelity if f.bits in best]
    points.sort(key=lambda point: point[0])
    axes.plot([x for x, _ in points], [f.identical for _, f in points], marker="o", label="identical outputs")
    axes.plot([x for x, _ in points], [f.matched_prefix for _, f in points], marker="s", label="matched prefix")
    for x, fidelity in points:
        axes.annotate(f"{fidelity.bits}-bit", (x, fidelity.matched_prefix), fontsize=7, xytext=(3, -10),
                      textcoords="offset points")
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("share of full-KV output kept")
    tasks = ", ".join(report.tasks)
    axes.set_title(f"Greedy output from a prefix restored at each bit width\n({tasks}; x: best coder)", fontsize=10)
    axes.legend(fontsize=7)
