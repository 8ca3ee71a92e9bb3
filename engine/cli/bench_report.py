"""Benchmark reports as people read them: ``kvtier bench restore`` and ``bench ttft``
as text, and as plots (matplotlib, imported only to draw)."""

from __future__ import annotations

from pathlib import Path

from kvtier.tiers.links import Link


def format_restore(report: dict) -> str:
    """``kvtier bench restore``'s report as a table and a few lines."""
    limits, peer = report["limits"], report["peer"]
    lines = [
        f"best of {report['rounds']} interleaved rounds; ratio: memcpy time (one thread) / restore time, same bytes",
        f"{'restore':<12} {'pages':>6} {'MiB':>8} {'GiB/s':>7} {'memcpy':>7} {'2thr':>6} {'ratio':>6}",
    ]
    lines += [
        f"{row['row']:<12} {row['pages']:>6} {row['bytes'] / (1 << 20):>8.1f} {row['gib_s']:>7.2f} "
        f"{row['memcpy_gib_s']:>7.2f} {row['memcpy_2_threads_gib_s']:>6.2f} {row['ratio_to_memcpy']:>6.2f}"
        for row in report["restores"]
    ]
    lines += [
        "",
        f"whole prompt ({limits['bytes'] / (1 << 20):.0f} MiB): memcpy {limits['memcpy_gib_s']:.2f} GiB/s "
        f"(two threads {limits['memcpy_2_threads_gib_s']:.2f}), LMDB zero-copy read "
        f"{limits['lmdb_zero_copy_read_gib_s']:.2f}, zstd decompress {limits['zstd_decompress_gib_s']:.2f}",
        f"restore from L3, every checksum verified, {peer['ours_l3_gib_s']:.2f} GiB/s vs mlx_lm "
        f"load_prompt_cache {peer['load_prompt_cache_gib_s']:.2f} GiB/s: {peer['ratio']:.2f}x",
    ]
    lines += [
        f"encrypted L3 restore ({row['pages']} pages): {row['ratio']:.2f}x the time of the plain one"
        for row in report.get("encryption", ())
    ]
    lines += [
        f"break-even prompt length for {tier}: {tokens if tokens else 'never (recompute wins)'} tokens"
        for tier, tokens in report["break_even_tokens"].items()
    ]
    return "\n".join(lines)


def plot_restore(report: dict, path: Path) -> None:
    """Restore bandwidth against size, per row, beside memcpy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["row"] for r in report["restores"]):
        rows = [r for r in report["restores"] if r["row"] == name]
        ax.plot([r["bytes"] / (1 << 20) for r in rows], [r["gib_s"] for r in rows], marker="o", label=name)
    rows = [r for r in report["restores"] if r["row"] == Link.L2_L1]
    ax.plot([r["bytes"] / (1 << 20) for r in rows], [r["memcpy_gib_s"] for r in rows], "k:", label="memcpy")
    ax.set(
        xscale="log",
        xlabel="restore size (MiB)",
        ylabel="GiB/s",
        title=f"kvtier restore bandwidth (best of {report['rounds']} rounds)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def format_ttft(report: dict) -> str:
    """``kvtier bench ttft``'s report: ratios to recomputing per length and tier."""
    tiers = report["sources"][1:]
    lines = [
        f"model {report['model']}, page {report['page_size']} tokens, best of {report['rounds']} "
        f"round(s); BLAS: {report['blas']}",
        "TTFT as a ratio to recomputing the same prompt (below 1: restoring wins)",
        f"{'tokens':>7} {'restored':>8} {'recompute s':>11} " + " ".join(f"{t:>6}" for t in tiers),
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['prompt_tokens']:>7} {row['restored_tokens']:>8} {row['ttft_s']['recompute']:>11.3f} "
            + " ".join(f"{row['ratio_to_recompute'][t]:>6.3f}" for t in tiers)
        )
    lines += [
        f"encrypted L3 restore ({row['prompt_tokens']} tokens): TTFT {row['ratio']:.2f}x the plain L3 one's"
        for row in report.get("encryption", ())
    ]
    for tier, tokens in report["break_even_tokens"].items():
        lines.append(
            f"{tier} beats recompute "
            + (f"from {tokens} tokens on (measured)" if tokens else "at no length measured up to the longest")
        )
    return "\n".join(lines)


def plot_ttft(report: dict, path: Path) -> None:
    """TTFT against prompt length, log scales; each tier's measured break-even ringed."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    lengths = [row["prompt_tokens"] for row in report["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, source in enumerate(report["sources"]):
        seconds = [row["ttft_s"][source] for row in report["rows"]]
        recompute = source == "recompute"
        label = (
            source
            if recompute
            else f"{source} ({report['rows'][-1]['ratio_to_recompute'][source]:.2g}x at {lengths[-1]})"
        )
        color = "black" if recompute else f"C{i - 1}"
        ax.plot(lengths, seconds, marker="o", label=label, color=color, linewidth=2.5 if recompute else 1.5)
        if (tokens := report["break_even_tokens"].get(source)) is not None:
            ax.plot(
                [tokens],
                [seconds[lengths.index(tokens)]],
                "o",
                markersize=14,
                markerfacecolor="none",
                markeredgecolor=color,
                markeredgewidth=1.5,
            )
    ax.plot(
        [],
        [],
        "o",
        markersize=14,
        markerfacecolor="none",
        markeredgecolor="gray",
        label="break-even (measured): restoring wins from here on",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(
        xlabel="prompt tokens",
        ylabel="time to first token (s)",
        title=f"kvtier TTFT: {report['model']}, page {report['page_size']}",
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
