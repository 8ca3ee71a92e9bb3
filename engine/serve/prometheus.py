"""Prometheus metrics (DESIGN §5): the one place where every series is named.

The server's ``GET /metrics`` and ``kvtier stats --prometheus`` both render an
``EngineStats`` through :class:`StatsCollector`, so a series has the same name and type in
both: counters end in ``_total`` (``kvtier_prompt_tokens_total{source}``,
``kvtier_link_pages_total{link}``), gauges do not (``kvtier_tier_pages{tier}``). The
server reads ``Engine.stats()`` at every scrape, so its figures are never stale and
never counted twice, and adds what only it sees: the latency histograms (time to
first token, time in the queue) and its waiting and running requests. A store's
persisted counters have no window and no cost model; they add the size of the
store's file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.costmodel.summary import ProfileSummary
from kvtier.tiers.counters import GAUGES, LinkStats, TierStats
from kvtier.tiers.links import Link

from ..stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# What describes a tier now; every other tier field, and every link field, only grows.
TIER_GAUGES = (*GAUGES, "file_bytes")
ENGINE_COUNTERS = ("requests", "generated_tokens", "l1_hit_loss_tokens", "store_seconds")


class StatsCollector(Collector):
    """Turns one ``EngineStats`` into metric families, labelled by tier, link, source:
    an ``Engine.stats()`` or the counters a store persisted (parts it lacks are left
    out, and so are the gauges of tiers it cannot see)."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if (store := stats.store) is not None:
            yield from _tiers("tier", store.tiers, store.ungauged, store.l3.file_bytes if store.l3 else None)
            yield from _links("link", store.links)
            if store.l3 is not None:
                yield CounterMetricFamily(
                    "kvtier_l3_reads_abandoned",
                    "L3 reads abandoned at their deadline for recompute",
                    value=store.reads_abandoned,
                )
            if (snapshots := store.snapshots) is not None:  # a hybrid model's state snapshots
                yield from _tiers("snapshot_tier", snapshots.tiers, snapshots.ungauged, None)
                yield from _links("snapshot_link", snapshots.links)
        if (totals := stats.totals) is not None:
            sources = CounterMetricFamily(
                "kvtier_prompt_tokens", "prompt tokens by where they came from", labels=["source"]
            )
            for source, tokens in totals.sources.items():
                sources.add_metric([source], tokens)
            yield sources
            for name in ENGINE_COUNTERS:
                yield CounterMetricFamily(f"kvtier_{name}", f"kvtier engine {name}", value=getattr(totals, name))
        if (window := stats.windowed) is not None:
            yield GaugeMetricFamily(
                "kvtier_cached_tokens_per_second",
                f"restored prompt tokens per second over the last {window.window_s:.0f} s",
                value=window.cached_tokens_per_s,
            )
        if stats.costmodel is not None:
            yield from _costmodel_errors(stats.costmodel)


def format_stats(stats: EngineStats) -> str:
    """``stats`` in the Prometheus text exposition format (``kvtier stats --prometheus``)."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: stats))
    return generate_latest(registry).decode()


def _tiers(
    label: str, rows: Mapping[str, TierStats], ungauged: frozenset[str], l3_file: int | None
) -> Iterator[Metric]:
    """One family per field: ``kvtier_tier_pages{tier="L1"}`` (a gauge), ``kvtier_tier_hit_pages_total``;
    ``kvtier_tier_file_bytes{tier="L3"}`` where the store's file size is known."""
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for row, tier in rows.items():
        values = dict(asdict(tier))
        if row in ungauged:
            values = {k: v for k, v in values.items() if k not in GAUGES}
        if row == "L3" and l3_file is not None:
            values["file_bytes"] = l3_file
        for name, value in values.items():
            if name not in families:
                kind = GaugeMetricFamily if name in TIER_GAUGES else CounterMetricFamily
                families[name] = kind(f"kvtier_{label}_{name}", f"kvtier {name} per {label}", labels=[label])
            families[name].add_metric([row], value)
    yield from families.values()


def _links(label: str, rows: Mapping[Link, LinkStats]) -> Iterator[Metric]:
    """One counter family per field: ``kvtier_link_bytes_total{link="L3->L1"}``."""
    for name in ("bytes", "pages", "seconds"):
        family = CounterMetricFamily(f"kvtier_{label}_{name}", f"kvtier {name} per {label}", labels=[label])
        for link, stats in rows.items():
            family.add_metric([link], getattr(stats, name))
        if rows:
            yield family


def _costmodel_errors(summary: ProfileSummary) -> Iterator[Metric]:
    """Relative error of the cost model's predictions against measured times, per link and for prefill."""
    parts = {name: fit.error for name, fit in summary.links.items()}
    if summary.compute is not None:
        parts["prefill"] = summary.compute.error
    median = GaugeMetricFamily("kvtier_costmodel_error_median", "median relative prediction error", labels=["part"])
    p90 = GaugeMetricFamily("kvtier_costmodel_error_p90", "90th percentile relative prediction error", labels=["part"])
    checked = CounterMetricFamily(
        "kvtier_costmodel_predictions_checked", "predictions checked against a measurement", labels=["part"]
    )
    for part, error in parts.items():
        if error.count:
            median.add_metric([part], error.median)
            p90.add_metric([part], error.p90)
        checked.add_metric([part], error.count)
    yield from (median, p90, checked)


class ServerMetrics:
    """The registry that ``GET /metrics`` renders."""

    def __init__(self, stats: Callable[[], EngineStats], server_gauges: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(stats))
        self.registry.register(_Gauges(server_gauges))
        self.ttft = Histogram(
            "kvtier_ttft_seconds",
            "time from submission to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "kvtier_queue_seconds",
            "time from submission to admission into the batch",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges(Collector):
    """Server-side gauges read at scrape time (waiting and running requests)."""

    def __init__(self, read: Callable[[], dict[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        for name, value in self._read().items():
            yield GaugeMetricFamily(f"kvtier_server_{name}", f"requests {name}", value=value)
