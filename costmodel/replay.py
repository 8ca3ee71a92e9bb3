"""Trace replay (DESIGN §8c): which hit ratio and prefill time given caps and a policy give.

A Mooncake trace (``costmodel.trace``) is replayed against the real ``TieredStore``: its
L1/L2/L3 code paths, caps, pins, eviction, spill, write-once and admission, on a store
of its own. Beside each replay the report gives what no store could beat
(``costmodel.bounds``); ``costmodel.replay_report`` prints and plots it.

- Payloads are a few bytes, but every cap counts each page as
  ``kv_bytes_per_token * page_size`` bytes (``StoreConfig.page_bytes``), and link
  bytes are link pages times that size.
- Time is simulated, never measured: requests arrive at their timestamps (divided
  by ``speed``) and queue FIFO on one engine; each takes the time of the plan
  ``plan_restore`` chooses (the engine's restore-or-recompute choice), then decodes
  ``output_length`` tokens, one step of the compute model each. Only prompt pages
  are published: a trace has no ids for the pages of an answer.
- The L3 writer is settled after every request, so a replay is deterministic.
- A hybrid model (``snapshot_bytes``, a snapshot's bytes): each request keeps a snapshot
  after its snapshot pages (``costmodel.spacing``: every ``snapshot_spacing`` pages, or
  the cost model's choice, and its last full page), each counted as ``snapshot_bytes``
  in the snapshot tiers' caps and on the links; a prefix is restored only up to a
  snapshot (``TieredStore.restore_points``), and the plan prices its snapshot's read
  (``costmodel.plan.snapshot_seconds``: on the links of its last page's tier). The snapshots' L3
  records count as pages against L3's cap (one size for every record there).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.links import Link
from kvtier.tiers.page import GLOBAL, LayerKind, Namespace, PageGeometry, PageKey, Source
from kvtier.tiers.policy import DEFAULT_POLICY

from .bounds import BELADY, belady, compute_saved, infinite_cache
from .models import ComputeModel
from .plan import plan_restore
from .profile import Profile
from .spacing import choose_spacing, snapshot_pages
from .trace import BLOCK_TOKENS, SyntheticPrompts, TraceRequest, page_names

SOURCES = tuple(s.value for s in Source)
_STATE = LayerKind("state", arrays=(("float16", (2,)),))  # the replay's snapshot payload: 4 bytes


def decode_seconds(compute: ComputeModel, context: int, tokens: int) -> float:
    """Decoding ``tokens`` tokens after ``context``, one compute-model step each:
    the sum of ``c0 + c1 + c2*(p + 1/2)`` for p = context .. context + tokens - 1."""
    c0, c1, c2 = compute.coef
    return tokens * (c0 + c1 + c2 * (context + 0.5)) + c2 * tokens * (tokens - 1) / 2


@dataclass
class ReplayConfig:
    kv_bytes_per_token: int
    page_size: int = BLOCK_TOKENS
    l1_bytes: int = 1 << 30
    l2_bytes: int = 4 << 30
    l3_bytes: int = 32 << 30
    policy: str = DEFAULT_POLICY
    l3_admit: str = "always"
    speed: float = 1.0
    snapshot_bytes: int = 0  # a hybrid model's state snapshot (0: no state layers)
    snapshot_spacing: int = 0  # pages between snapshots; 0: the cost model's choice per prompt
    snapshot_l1_bytes: int = StoreConfig.snapshot_l1_bytes
    snapshot_l2_bytes: int = StoreConfig.snapshot_l2_bytes
    l3_write_budget: float | None = None  # bytes per second of the trace's own time (None: unbudgeted)
    l3_write_through: bool = False  # each published page queued for L3 at once (a fleet's shared L3)

    def snapshot_points(self, profile: Profile) -> Callable[[TraceRequest], list[int]] | None:
        """The pages after which a request keeps a snapshot; None without state layers."""
        if not self.snapshot_bytes:
            return None
        size = self.page_size

        def points(request: TraceRequest) -> list[int]:
            n = request.input_length
            spacing = self.snapshot_spacing or choose_spacing(profile, size, self.snapshot_bytes, n)
            return snapshot_pages(n, size, spacing)

        return points

    @property
    def page_bytes(self) -> int:
        return self.kv_bytes_per_token * self.page_size

    @property
    def label(self) -> str:
        label = self.policy if self.l3_admit == "always" else f"{self.policy}+{self.l3_admit}"
        return label if self.l3_write_budget is None else f"{label}+budget"


@dataclass
class ReplayResult:
    """What one replay measured (``report`` turns it into the published numbers)."""

    config: ReplayConfig
    prompt_tokens: int = 0
    sources: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    prefill_seconds_saved: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)  # restored tokens per request
    links: dict[str, int] = field(default_factory=dict)  # link -> bytes (pages and snapshots)
    snapshot_links: dict[str, int] = field(default_factory=dict)  # link -> bytes of snapshots only
    l3_snapshots_written: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)  # most each tier held after a request
    capacity: dict[str, int] = field(default_factory=dict)
    l3_pages_written: int = 0
    l3_writes_refused: int = 0  # by the admission filter
    l3_writes_over_budget: int = 0  # refused by the write budget (L1's and L2's writes_over_budget)
    makespan_s: float = 0.0
    trace_s: float = 0.0  # from the first arrival to the last, in the trace's own time (before ``speed``)
    # Pages of a request that some tier held when it arrived: reachable (the found
    # prefix) or stranded (held, but after a page no tier held: never usable by it).
    held_pages: int = 0
    stranded_pages: int = 0
    unreachable_at_eviction: float = 0.0  # TieredStore.lineage.unreachable_share()

    def report(self, distinct_pages: int) -> dict:
        c, restored = self.config, self.prompt_tokens - self.sources[Source.RECOMPUTED.value]
        written = self.l3_pages_written * c.page_bytes + self.l3_snapshots_written * c.snapshot_bytes
        p50, p90, p99 = np.percentile(self.ttft_s, [50, 90, 99]) if self.ttft_s else (0.0, 0.0, 0.0)
        return {
            "policy": c.label,
            "eviction": c.policy,
            "l3_admit": c.l3_admit,
            "l1_bytes": c.l1_bytes,
            "l2_bytes": c.l2_bytes,
            "l3_bytes": c.l3_bytes,
            "reused_ratio": restored / max(self.prompt_tokens, 1),
            "reused_tokens": restored,
            "sources": dict(self.sources),
            "prefill_seconds_saved": self.prefill_seconds_saved,
            "ttft_p50_s": float(p50),
            "ttft_p90_s": float(p90),
            "ttft_p99_s": float(p99),
            "link_bytes": dict(self.links),
            "snapshot_bytes": c.snapshot_bytes,
            "snapshot_link_bytes": dict(self.snapshot_links),
            "l3_bytes_written": written,
            "l3_write_amplification": written / max(distinct_pages * c.page_bytes, 1),
            "l3_bytes_per_day": written * 86400 / self.trace_s if self.trace_s else 0.0,
            "l3_writes_refused": self.l3_writes_refused,
            "l3_write_budget_bytes_per_day": c.l3_write_budget * 86400 if c.l3_write_budget else None,
            "l3_writes_over_budget": self.l3_writes_over_budget,
            "evictions": dict(self.evictions),
            "peak_bytes": dict(self.peak_bytes),
            "makespan_s": self.makespan_s,
            "unreachable_ratio": self.stranded_pages / max(self.held_pages, 1),
            "unreachable_at_eviction": self.unreachable_at_eviction,
        }


class Replay:
    """One trace through one fresh store under one ``ReplayConfig``."""

    def __init__(self, trace: Sequence[TraceRequest], config: ReplayConfig, profile: Profile) -> None:
        self.trace, self.config, self.profile = trace, config, profile
        kinds = (_STATE, GLOBAL) if config.snapshot_bytes else ()
        self.geometry = PageGeometry(1, 1, 1, config.page_size, "float16", kinds)  # 4 bytes a token
        self.namespace = Namespace(
            "kvtier-trace-replay", "float16", config.page_size, layers=self.geometry.describe_layers()
        )
        self.kv = mx.zeros(self.geometry.shape, dtype=mx.float16)  # every page's payload
        self.state = mx.zeros(_STATE.nbytes, dtype=mx.uint8)  # every snapshot's
        self.snapshot_points = config.snapshot_points(profile)
        self.now = 0.0  # the store's clock: the trace's own time of the request being served

    def run(self, on_request: Callable[[], None] | None = None) -> ReplayResult:
        with tempfile.TemporaryDirectory(prefix="kvtier-replay-", dir=fast_tmp()) as tmp:
            store = self.new_store(self.store_config(Path(tmp)))
            try:
                result = ReplayResult(self.config)
                if self.trace:
                    result.trace_s = self.trace[-1].arrival_s - self.trace[0].arrival_s
                free_at = 0.0
                prompts = SyntheticPrompts(self.namespace)
                for request in self.trace:
                    _, free_at = self.serve(store, request, prompts.pages(request), free_at, result)
                    self._watch_caps(store, result)
                    if on_request is not None:
                        on_request()
                self._collect(store, result)
                result.makespan_s = free_at
                return result
            finally:
                store.close()

    def new_store(self, config: StoreConfig) -> TieredStore:
        """A store for this replay, whose pages cost their recompute by the profile's
        prefill model at their depth (as the engine's do)."""
        store = TieredStore(self.geometry, self.namespace, config)
        store.page_cost.by_index = self.profile.compute.page_costs(self.config.page_size)
        return store

    def store_config(self, store_dir: Path) -> StoreConfig:
        c = self.config
        return StoreConfig(
            l1_bytes=c.l1_bytes,
            l2_bytes=c.l2_bytes,
            l3_bytes=c.l3_bytes,
            store_dir=store_dir,
            policy=c.policy,
            l3_admit=c.l3_admit,
            page_bytes=c.page_bytes,
            l3_queue_pages=1 << 20,
            snapshot_l1_bytes=self._snapshot_cap(c.snapshot_l1_bytes),
            snapshot_l2_bytes=self._snapshot_cap(c.snapshot_l2_bytes),
            l3_write_budget=c.l3_write_budget,
            clock=lambda: self.now,
            l3_write_through=c.l3_write_through,
        )

    def _snapshot_cap(self, cap: int) -> int:
        """A snapshot cap in the replay's payloads: as many snapshots as ``cap`` holds."""
        return cap // self.config.snapshot_bytes * _STATE.nbytes if self.config.snapshot_bytes else cap

    def serve(
        self,
        store: TieredStore,
        request: TraceRequest,
        pages: tuple[list[PageKey], list[int]],
        free_at: float,
        result: ReplayResult,
    ) -> tuple[float, float]:
        """One engine's step: restore, publish and time one request (its ``pages``: keys and
        tokens, ``SyntheticPrompts.pages``) on ``store``, an engine free from ``free_at``
        (simulated seconds), counted in ``result``. Returns when its first token comes and
        when the engine is free again (the fleet replay, ``costmodel.fleet_replay``, steps
        each of its engines with it)."""
        size, compute = self.config.page_size, self.profile.compute
        keys, tokens = pages
        self.now = request.arrival_s
        matched = store.locate(keys, tokens)
        stranded = sum(map(store.has, keys[len(matched) + 1 :]))
        result.held_pages += len(matched) + stranded
        result.stranded_pages += stranded
        points = store.restore_points(keys[: len(matched)])
        plan = plan_restore(
            matched,
            request.input_length,
            size,
            self.config.page_bytes,
            self.profile,
            points=points,
            snapshot_bytes=self.config.snapshot_bytes,
        )
        if points is None:
            restored = [
                *self._restore(store, keys[: plan.l1_pages], tokens, 0),  # as the engine does
                *self._restore(store, keys[: plan.restore_pages], tokens, plan.first_loaded),
            ]
        else:  # serially, up to a snapshot
            restored = list(self._restore(store, keys[: plan.restore_pages], tokens, 0))
        for _key, source in restored:
            result.sources[source.value] += size
        result.sources[Source.RECOMPUTED.value] += request.input_length - len(restored) * size
        result.reused.append(len(restored) * size)
        result.prompt_tokens += request.input_length
        for i in range(plan.restore_pages, len(keys)):  # as the engine publishes: with its cost at its depth
            page = tokens[i * size : (i + 1) * size]
            store.publish(keys[i], page, self.kv, store.page_cost(i), parent=keys[i - 1] if i else None)
        for j in self.snapshot_points(request) if self.snapshot_points else ():
            if j > len(restored):
                store.publish_snapshot(keys[j - 1], tokens[(j - 1) * size : j * size], self.state)
        store.release([key for key, _ in restored])
        store.settle()
        seconds = plan.predicted_s  # a hybrid plan's includes the snapshot's read
        arrival = request.arrival_s / self.config.speed
        start = max(arrival, free_at)
        result.ttft_s.append(start + seconds - arrival)
        result.prefill_seconds_saved += plan.recompute_s - seconds
        return start + seconds, start + seconds + decode_seconds(compute, request.input_length, request.output_length)

    @staticmethod
    def _restore(
        store: TieredStore, keys: list[PageKey], tokens: list[int], first: int
    ) -> Iterator[tuple[PageKey, Source]]:
        """Pin and load pages ``first ..`` of ``keys``: (key, tier) of each."""
        if first >= len(keys):
            return iter(())
        prefix = store.restore(keys, tokens, first)
        return zip(prefix.keys, prefix.sources)

    def _watch_caps(self, store: TieredStore, result: ReplayResult) -> None:
        for name, tier in store.stats().tiers.items():
            result.peak_bytes[name] = max(result.peak_bytes.get(name, 0), tier.bytes_used)
            result.capacity[name] = tier.capacity

    def _collect(self, store: TieredStore, result: ReplayResult) -> None:
        stats = store.stats()
        snapshots = stats.snapshots.links if stats.snapshots is not None else {}
        result.snapshot_links = {name: link.pages * self.config.snapshot_bytes for name, link in snapshots.items()}
        result.links = {
            name: link.pages * self.config.page_bytes + result.snapshot_links.get(name, 0)
            for name, link in stats.links.items()
        }
        written = sum(snapshots[link].pages for link in (Link.L1_L3, Link.L2_L3) if link in snapshots)
        result.l3_snapshots_written = written
        result.evictions = {name: tier.evictions for name, tier in stats.tiers.items()}
        result.l3_pages_written = (stats.tiers["L3"].inserts if "L3" in stats.tiers else 0) - written  # L3 counts both
        result.l3_writes_refused = store.admission.rejected
        result.l3_writes_over_budget = sum(t.writes_over_budget for n, t in stats.tiers.items() if n != "L3")
        result.unreachable_at_eviction = store.lineage.unreachable_share()


def fast_tmp() -> str | None:
    """A RAM-backed temporary directory when there is one (L3 commits sync each batch)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and _writable(shm) else None


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def replay(
    trace: Sequence[TraceRequest],
    configs: Sequence[ReplayConfig],
    profile: Profile,
    on_request: Callable[[], None] | None = None,
) -> dict:
    """Replay ``trace`` once per config; the report ``kvtier replay --json`` prints."""
    page_size = configs[0].page_size
    bound = infinite_cache(trace, page_size, configs[0].snapshot_points(profile))
    prompt_tokens = sum(r.input_length for r in trace)
    distinct = len({name for r in trace for name in page_names(r, page_size)})
    saved = compute_saved(trace, bound, profile)
    rows = [
        _belady_row(trace, c, profile, prompt_tokens)
        if c.policy == BELADY
        else Replay(trace, c, profile).run(on_request).report(distinct)
        for c in configs
    ]
    bound_ratio = sum(bound) / max(prompt_tokens, 1)
    offline: dict[int, float] = {}  # pages of L1 + L2 + L3 -> Belady's reused ratio
    for row, c in zip(rows, configs):
        if c.policy != BELADY:
            pages = _capacity_pages(c)
            if pages not in offline:
                offline[pages] = sum(belady(trace, c.page_size, pages)) / max(prompt_tokens, 1)
            row["bound_gap_points"] = 100 * (bound_ratio - row["reused_ratio"])
            row["belady_gap_points"] = 100 * (offline[pages] - row["reused_ratio"])
    return {
        "requests": len(trace),
        "prompt_tokens": prompt_tokens,
        "page_size": page_size,
        "page_bytes": configs[0].page_bytes,
        "distinct_pages": distinct,
        "profile": "calibrated" if profile.calibrated else "defaults",
        "infinite_cache": {
            "reused_ratio": sum(bound) / max(prompt_tokens, 1),
            "reused_tokens": sum(bound),
            "prefill_seconds_saved": saved,
        },
        "policies": rows,
    }


def _belady_row(trace: Sequence[TraceRequest], config: ReplayConfig, profile: Profile, prompt_tokens: int) -> dict:
    """Belady's reuse for the config's L1 + L2 + L3 as one cache (no store, no timing)."""
    reused = belady(trace, config.page_size, _capacity_pages(config))
    return {
        "policy": BELADY,
        "eviction": BELADY,
        "l3_admit": None,
        "l1_bytes": config.l1_bytes,
        "l2_bytes": config.l2_bytes,
        "l3_bytes": config.l3_bytes,
        "reused_ratio": sum(reused) / max(prompt_tokens, 1),
        "reused_tokens": sum(reused),
        "prefill_seconds_saved": compute_saved(trace, reused, profile),
    }


def _capacity_pages(config: ReplayConfig) -> int:
    """The pages L1 + L2 + L3 hold together: the one cache Belady's bound is given."""
    return (config.l1_bytes + config.l2_bytes + config.l3_bytes) // config.page_bytes


def configs_for(
    base: ReplayConfig,
    policies: Sequence[str],
    admits: Sequence[str],
    l2_sweep: Sequence[int] = (),
    budgets: Sequence[float | None] = (None,),
) -> list[ReplayConfig]:
    """One config per L2 size (or the base one), policy, admission and L3 write budget, in
    that order (belady, which has neither, once per L2 size)."""
    return [
        replace(base, l2_bytes=l2, policy=p, l3_admit=a, l3_write_budget=b)
        for l2 in (l2_sweep or [base.l2_bytes])
        for p in policies
        for a in admits
        for b in budgets
        if p != BELADY or (a, b) == (admits[0], budgets[0])
    ]
