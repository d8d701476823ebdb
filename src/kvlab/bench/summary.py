"""A cell's summary from its per-sample records: mean quality, fidelity to full KV, median system cost.

Pure functions of plain dicts (the JSONL records), so a report can recompute them from files.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from kvlab.bench.likelihood import likelihood_means
from kvlab.bench.metrics import first_divergence, matched_prefix_fraction, output_exact_match

# Per-sample timing and size fields of `GenerationStats` the summary reports as medians.
MEDIAN_STATS = (
    "ttft_s",
    "decode_tokens_per_s",
    "decode_s",
    "kv_bytes_ratio",
    "kv_bytes",
    "prompt_tokens",
    "new_tokens",
)


def median_stats(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-field median over repeated runs of one sample (numbers only; the first run's other fields)."""
    merged = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = statistics.median(run[key] for run in runs)
    return merged


def quality_means(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean of every score over the samples."""
    keys = sorted({key for record in records for key in record["scores"]})
    return {key: statistics.fmean(record["scores"].get(key, 0.0) for record in records) for key in keys}


def fidelity(records: Sequence[dict[str, Any]], full_records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How closely outputs follow the full-KV outputs of the same samples.

    Returns:
        `output_exact_match` (share of samples whose whole output is identical), `matched_prefix`
        (mean share of the full-KV output reproduced before diverging), `first_divergence_median`
        (median token index of the first difference among diverging samples, None if none diverged)
        and `num_compared` (samples present in both).
    """
    full_by_id = {record["id"]: record["token_ids"] for record in full_records}
    pairs = [(r["token_ids"], full_by_id[r["id"]]) for r in records if r["id"] in full_by_id]
    if not pairs:
        return {"output_exact_match": None, "matched_prefix": None, "first_divergence_median": None, "num_compared": 0}
    divergences = [d for d in (first_divergence(ours, full) for ours, full in pairs) if d is not None]
    return {
        "output_exact_match": statistics.fmean(output_exact_match(ours, full) for ours, full in pairs),
        "matched_prefix": statistics.fmean(matched_prefix_fraction(ours, full) for ours, full in pairs),
        "first_divergence_median": statistics.median(divergences) if divergences else None,
        "num_compared": len(pairs),
    }


def system_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over samples of the timing and size fields, plus the peaks."""
    summary: dict[str, Any] = {
        key: statistics.median(record["stats"][key] for record in records) for key in MEDIAN_STATS
    }
    summary["peak_kv_resident_bytes"] = max(record["stats"]["kv_resident_bytes"] for record in records)
    device_peaks = [record["memory"]["device_bytes"] for record in records if record["memory"]["device_bytes"]]
    summary["peak_device_bytes"] = max(device_peaks) if device_peaks else None
    summary["process_rss_bytes"] = max(record["memory"]["process_rss_bytes"] for record in records)
    acceptance = [record["lossless"]["acceptance_length"] for record in records if record.get("lossless")]
    summary["acceptance_length"] = statistics.median(acceptance) if acceptance else None
    return summary


def per_turn(records: Sequence[dict[str, Any]], full_records: Sequence[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Shared-context tasks: quality and fidelity per turn, `{turn: {quality, output_exact_match, ...}}`.

    Empty for tasks whose records carry no turn.
    """
    turns = sorted({record["turn"] for record in records if record.get("turn") is not None})
    summary: dict[str, Any] = {}
    for turn in turns:
        mine = [record for record in records if record.get("turn") == turn]
        figures = fidelity(mine, full_records)
        summary[str(turn)] = {
            "quality": statistics.fmean(record["scores"].get(metric, 0.0) for record in mine),
            "output_exact_match": figures["output_exact_match"],
            "matched_prefix": figures["matched_prefix"],
            "num_samples": len(mine),
        }
    return summary


def summarize_cell(
    records: Sequence[dict[str, Any]],
    full_records: Sequence[dict[str, Any]],
    primary_metric: str,
    header: dict[str, Any],
) -> dict[str, Any]:
    """The cell's `metrics.json`: `header` (task, method, ...) plus quality, fidelity, likelihood (None when
    not measured) and system figures."""
    quality = quality_means(records)
    return {
        **header,
        "num_samples": len(records),
        "primary_metric": primary_metric,
        "primary": quality.get(primary_metric),
        "quality": quality,
        "fidelity": fidelity(records, full_records),
        "likelihood": likelihood_means(records),
        "system": system_summary(records),
        "per_turn": per_turn(records, full_records, primary_metric),
    }
