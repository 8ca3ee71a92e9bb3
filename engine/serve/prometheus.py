"""Prometheus metrics (DESIGN §5): the one place where every series is named.

The server's ``GET /metrics`` and ``kvtier stats --prometheus`` both render a stats
dict through :class:`StatsCollector`, so a series has the same name and type in
both: counters end in ``_total`` (``kvtier_prompt_tokens_total{source}``,
``kvtier_link_pages_total{link}``), gauges do not (``kvtier_tier_pages{tier}``). The
server reads ``Engine.stats()`` at every scrape, so its figures are never stale and
never counted twice, and adds what only it sees: the latency histograms (time to
first token, time in the queue) and its waiting and running requests. A store's
persisted counters have no window and no cost model; they add the size of the
store's file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.tiers.counters import GAUGES

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# What describes a tier now; every other tier field, and every link field, only grows.
TIER_GAUGES = (*GAUGES, "file_bytes")
ENGINE_COUNTERS = ("requests", "generated_tokens", "l1_hit_loss_tokens", "store_seconds")


class StatsCollector(Collector):
    """Turns one stats dict into metric families, labelled by tier, link, source: an
    ``Engine.stats()`` or the counters a store persisted (parts it lacks are left out)."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield from _table("tier", stats.get("tiers", {}), gauges=TIER_GAUGES)
        yield from _table("link", stats.get("links", {}), gauges=())
        if engine := stats.get("engine"):
            sources = CounterMetricFamily(
                "kvtier_prompt_tokens", "prompt tokens by where they came from", labels=["source"]
            )
            for source, tokens in engine.get("sources", {}).items():
                sources.add_metric([source], tokens)
            yield sources
            for name in ENGINE_COUNTERS:
                if name in engine:
                    yield CounterMetricFamily(f"kvtier_{name}", f"kvtier engine {name}", value=engine[name])
        if window := stats.get("windowed"):
            yield GaugeMetricFamily(
                "kvtier_cached_tokens_per_second",
                f"restored prompt tokens per second over the last {window['window_s']:.0f} s",
                value=window["cached_tokens_per_s"],
            )
        if "costmodel" in stats:
            yield from _costmodel_errors(stats["costmodel"])


def format_stats(stats: dict) -> str:
    """``stats`` in the Prometheus text exposition format (``kvtier stats --prometheus``)."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: stats))
    return generate_latest(registry).decode()


def _table(label: str, rows: dict[str, dict], gauges: tuple[str, ...]) -> Iterator[Metric]:
    """One family per field: ``kvtier_tier_pages{tier="L1"}``, ``kvtier_link_bytes_total{link="L3->L1"}``."""
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for row, fields in rows.items():
        for name, value in fields.items():
            if name not in families:
                kind = GaugeMetricFamily if name in gauges else CounterMetricFamily
                families[name] = kind(f"kvtier_{label}_{name}", f"kvtier {name} per {label}", labels=[label])
            families[name].add_metric([row], value)
    yield from families.values()


def _costmodel_errors(summary: dict) -> Iterator[Metric]:
    """Relative error of the cost model's predictions against measured times, per link and for prefill."""
    parts = {**summary["links"], "prefill": summary["compute"]}
    median = GaugeMetricFamily("kvtier_costmodel_error_median", "median relative prediction error", labels=["part"])
    p90 = GaugeMetricFamily("kvtier_costmodel_error_p90", "90th percentile relative prediction error", labels=["part"])
    checked = CounterMetricFamily(
        "kvtier_costmodel_predictions_checked", "predictions checked against a measurement", labels=["part"]
    )
    for part, fit in parts.items():
        error = fit["error"]
        if error.get("count"):
            median.add_metric([part], error["median"])
            p90.add_metric([part], error["p90"])
        checked.add_metric([part], error.get("count", 0))
    yield from (median, p90, checked)


class ServerMetrics:
    """The registry that ``GET /metrics`` renders."""

    def __init__(self, stats: Callable[[], dict], server_gauges: Callable[[], dict[str, int]]) -> None:
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
