"""Text tables of the codec benchmarks (the CLI prints them)."""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.bench.codec.fidelity import PAPER_BITS_PER_VALUE, RateFidelityReport, code_bits
from kvlab.bench.codec.harness import CodecBenchStats


def codec_table(results: Sequence[CodecBenchStats]) -> str:
    """One row per codec: bits per value, reduction against fp16, speed, losslessness, error."""
    header = f"{'codec':<34} {'bits/value':>10} {'vs fp16':>8} {'enc MB/s':>9} {'dec MB/s':>9} {'lossless':<10} " \
             f"{'verified':<8} {'max abs err':>11} {'rms err':>9}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.label:<34} {r.bits_per_value:>10.3f} {r.kv_bytes_ratio:>7.2f}x {r.encode_mb_s:>9.1f} "
            f"{r.decode_mb_s:>9.1f} {r.lossless:<10} {'yes' if r.verified else 'NO':<8} {r.max_abs_error:>11.3g} "
            f"{r.rms_error:>9.3g}"
        )
    return "\n".join(lines)


def rate_fidelity_tables(report: RateFidelityReport) -> str:
    """The rate table, the best coder per bit width beside the entropy bound, and task fidelity."""
    sections = ["Rate (every coder, keys and values together; metadata counted):", codec_table(report.rates)]
    sections += ["", (f"Best coder per bit width against the per-channel entropy bound "
                 f"(KVCodec's operating point: ~{PAPER_BITS_PER_VALUE} bits/value, 11.9x):")]
    header = f"{'bits':>4} {'best coder':<34} {'bits/value':>10} {'vs fp16':>8} {'H codes':>8} {'H resid':>8} " \
             f"{'meta':>6} {'bound':>7} {'bound vs fp16':>13}"
    sections += [header, "-" * len(header)]
    for bound in report.bounds:
        rows = [row for row in report.rates if code_bits(row) == bound.bits]
        if not rows:
            continue
        best = min(rows, key=lambda row: row.bits_per_value)
        sections.append(
            f"{bound.bits:>4} {best.label:<34} {best.bits_per_value:>10.3f} {best.kv_bytes_ratio:>7.2f}x "
            f"{bound.codes:>8.3f} {bound.residuals:>8.3f} {bound.metadata:>6.3f} {bound.best_bits_per_value:>7.3f} "
            f"{bound.kv_bytes_ratio:>12.2f}x"
        )
    sections += ["", "Video against the best non-video coder at the same bits (ratio and decode speed):"]
    header = f"{'bits':>4} {'video':<26} {'vs fp16':>8} {'dec MB/s':>9}   {'best other':<30} {'vs fp16':>8} " \
             f"{'dec MB/s':>9}"
    sections += [header, "-" * len(header)]
    for bits in sorted({code_bits(row) for row in report.rates}, reverse=True):
        rows = [row for row in report.rates if code_bits(row) == bits]
        video = [row for row in rows if row.codec == "video_codes"]
        other = [row for row in rows if row.codec != "video_codes"]
        if video and other:
            v = max(video, key=lambda row: row.kv_bytes_ratio)
            o = max(other, key=lambda row: row.kv_bytes_ratio)
            sections.append(f"{bits:>4} {v.label:<26} {v.kv_bytes_ratio:>7.2f}x {v.decode_mb_s:>9.1f}   "
                            f"{o.label:<30} {o.kv_bytes_ratio:>7.2f}x {o.decode_mb_s:>9.1f}")
    if report.fidelity:
        sections += ["", (f"Task fidelity: greedy output from a prefix restored through the store, against full KV "
                     f"({', '.join(report.tasks)}):")]
        header = f"{'bits':>4} {'resolution':<12} {'prompts':>7} {'identical':>9} {'matched prefix':>14} " \
                 f"{'reused tokens':>13}"
        sections += [header, "-" * len(header)]
        for fidelity in report.fidelity:
            sections.append(
                f"{fidelity.bits:>4} {fidelity.resolution:<12} {fidelity.num_prompts:>7} {fidelity.identical:>9.0%} "
                f"{fidelity.matched_prefix:>14.0%} {fidelity.reused_tokens:>13}"
            )
    return "\n".join(sections)
