"""Counters as people read them: text tables (the Prometheus format is engine/serve/prometheus.py).

Input is ``Engine.stats()`` or what a store persisted (``kvtier stats``,
``EngineStats.persisted``). Capacity gauges a reader cannot see (L1 and L2 of
processes that have ended: ``StoreStats.gauged``) are shown as ``-``, never as 0.
"""

from __future__ import annotations

import time
from dataclasses import fields

from kvtier.costmodel.summary import ErrorSummary
from kvtier.tiers.counters import GAUGES, TierStats
from kvtier.tiers.stats import SnapshotStats, StoreStats
from kvtier.tiers.text import format_bytes

from ..stats import LastRun
from ..totals import EngineTotals

_TIER_COLUMNS = tuple(f.name for f in fields(TierStats))  # a tier's counters, in JSON order


def format_tier_table(stats: StoreStats | SnapshotStats | None) -> str:
    """Per-tier and per-link counters as a text table; columns fit their headers."""
    rows = [["tier", *_TIER_COLUMNS]]
    for name, tier in (stats.tiers if stats else {}).items():
        known = stats is not None and name not in stats.ungauged
        rows.append([name, *(str(getattr(tier, c)) if known or c not in GAUGES else "-" for c in _TIER_COLUMNS)])
    lines = _aligned(rows)
    links = [
        [
            name,
            str(link.bytes),
            str(link.pages),
            f"{link.seconds:.4f}",
            f"{link.bytes / link.seconds / (1 << 30):.2f}" if link.seconds else "-",
        ]
        for name, link in (stats.links if stats else {}).items()
        if link.pages
    ]
    if links:
        lines += ["", *_aligned([["link", "bytes", "pages", "seconds", "GiB/s"], *links])]
    return "\n".join(lines)


def _aligned(rows: list[list[str]]) -> list[str]:
    """First column left-aligned, the others right-aligned, each as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        " ".join([row[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:]))]) for row in rows
    ]


def format_engine_totals(engine: EngineTotals) -> str:
    return "\n".join(
        [
            f"requests {engine.requests}  prompt tokens {engine.prompt_tokens}  generated {engine.generated_tokens}",
            "sources: " + "  ".join(f"{k}={v}" for k, v in engine.sources.items()),
            f"L1 hit loss between enqueue and admission: {engine.l1_hit_loss_tokens} tokens",
        ]
    )


def format_last_run(last: LastRun) -> str:
    """The last run's window and cost-model fit, with prediction errors."""
    window = last.windowed
    lines = [
        f"last run ({last.model}): cached tokens/s over {window.window_s if window else 0:.0f} s: "
        f"{window.cached_tokens_per_s if window else 0:.1f}"
    ]
    cost = last.costmodel
    lines.append(f"cost model: {'calibrated' if cost.calibrated else 'defaults'}")
    rows: list[tuple[str, str, ErrorSummary]] = [
        (name, f"setup {m.setup_s * 1e3:.3f} ms, {m.gib_s:.2f} GiB/s", m.error) for name, m in cost.links.items()
    ]
    if (c := cost.compute) is not None:
        rows.append(("prefill", f"{c.c0:.3g} + {c.c1:.3g}*n + {c.c2:.3g}*n*(p+n/2) s", c.error))
    for name, fit, error in rows:
        err = (
            f"error median {error.median:.0%}, p90 {error.p90:.0%} over {error.count}"
            if error.count
            else "no predictions checked yet"
        )
        lines.append(f"  {name:<8} {fit:<42} {err}")
    return "\n".join(lines)


def format_namespaces(listing: dict) -> str:
    """``kvtier store ls``: one row per namespace, then the store's totals."""
    rows = [["tier", "namespace", "model", "page_size", "dtype", "pages", "tokens", "bytes", "last_use"]]
    for ns in listing["namespaces"]:
        used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns["last_use"])) if ns["last_use"] else "-"
        rows.append(
            [
                "L3",
                ns["namespace"][:12],
                str(ns["model"]),
                str(ns["page_size"]),
                str(ns["dtype"]),
                str(ns["pages"]),
                str(ns["tokens"]),
                format_bytes(ns["bytes"]),
                used,
            ]
        )
    total = (
        f"{listing['pages']} pages, {format_bytes(listing['bytes_used'])} of a "
        f"{format_bytes(listing['capacity'])} cap; data.mdb {format_bytes(listing['file_bytes'])} on disk"
    )
    return "\n".join([*_aligned(rows), "", f"{listing['path']}: {total}"])
