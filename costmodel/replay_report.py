"""The report of a trace replay (``costmodel.replay.replay``) as a text table and a plot."""

from __future__ import annotations

from pathlib import Path

from .bounds import BELADY


def format_report(report: dict) -> str:
    """The report as a text table: one row per replay, the bound first."""
    gib = 1 << 30
    bound = report["infinite_cache"]
    lines = [
        f"{report['requests']} requests, {report['prompt_tokens']} prompt tokens, page {report['page_size']} "
        f"tokens = {report['page_bytes'] / (1 << 20):.1f} MiB, cost model: {report['profile']}",
        f"infinite cache: reused {bound['reused_ratio']:.1%}, prefill saved {bound['prefill_seconds_saved']:.0f} s",
        "",
        f"{'policy':<18} {'L1':>6} {'L2':>6} {'L3':>6} {'reused':>7} {'L1 tok':>10} {'L2 tok':>10} "
        f"{'L3 tok':>10} {'saved s':>9} {'ttft p50':>9} {'p90':>9} {'p99':>9} {'L3 GiB w':>9} "
        f"{'L3 amp':>6} {'TiB/day':>7} {'ev L1':>7} {'ev L2':>7} {'ev L3':>7} {'gap':>5} {'to opt':>6} "
        f"{'unreach':>7} {'at ev':>6}",
    ]
    for p in report["policies"]:
        if p["policy"] == BELADY:
            note = "(offline, one cache)"
            lines.append(
                f"{p['policy']:<18} {p['l1_bytes'] / gib:>5.0f}G {p['l2_bytes'] / gib:>5.0f}G "
                f"{p['l3_bytes'] / gib:>5.0f}G {p['reused_ratio']:>7.1%} {note:>32} "
                f"{p['prefill_seconds_saved']:>9.0f}"
            )
            continue
        src, ev = p["sources"], p["evictions"]
        lines.append(
            f"{p['policy']:<18} {p['l1_bytes'] / gib:>5.0f}G {p['l2_bytes'] / gib:>5.0f}G {p['l3_bytes'] / gib:>5.0f}G "
            f"{p['reused_ratio']:>7.1%} {src['L1']:>10} {src['L2']:>10} {src['L3']:>10} "
            f"{p['prefill_seconds_saved']:>9.0f} {p['ttft_p50_s']:>9.2f} {p['ttft_p90_s']:>9.2f} "
            f"{p['ttft_p99_s']:>9.2f} {p['l3_bytes_written'] / gib:>9.1f} {p['l3_write_amplification']:>6.2f} "
            f"{p['l3_bytes_per_day'] / (1 << 40):>7.1f} "
            f"{ev.get('L1', 0):>7} {ev.get('L2', 0):>7} {ev.get('L3', 0):>7} {p['bound_gap_points']:>5.1f} "
            f"{p['belady_gap_points']:>6.1f} {p['unreachable_ratio']:>7.1%} {p['unreachable_at_eviction']:>6.1%}"
        )
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    """Reused ratio and predicted TTFT p50 against L2 size, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reuse, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(p["policy"] for p in report["policies"]):
        rows = sorted((p for p in report["policies"] if p["policy"] == label), key=lambda p: p["l2_bytes"])
        sizes = [p["l2_bytes"] / (1 << 30) for p in rows]
        reuse.plot(
            sizes,
            [p["reused_ratio"] for p in rows],
            marker="o",
            label=label,
            linestyle="--" if label == BELADY else "-",
        )
        if label != BELADY:
            ttft.plot(sizes, [p["ttft_p50_s"] for p in rows], marker="o", label=label)
    reuse.axhline(report["infinite_cache"]["reused_ratio"], color="k", linestyle=":", label="infinite cache")
    reuse.set(xscale="log", xlabel="L2 GiB", ylabel="reused token ratio", title="reuse")
    ttft.set(xscale="log", xlabel="L2 GiB", ylabel="predicted TTFT p50 (s)", title="time to first token")
    reuse.legend()
    fig.tight_layout()
    fig.savefig(path)
