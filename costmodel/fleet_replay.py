"""A fleet on a trace (``kvtier replay --engines N --route ...``, DESIGN §11): which
routing policy reuses most and answers first when N engines share one L3.

Each engine is a real ``TieredStore`` of its own (its own L1 and L2, caps, eviction and
spill) over one L3 that all of them share, opened once (``StoreConfig.shared_l3``: LMDB
must not be opened twice in one process), so a page one engine spilled is found by the
others, as with backends that share a Redis L3. Each engine has its own FIFO queue and
clock, and serves a request exactly as the single-engine replay does
(``Replay.serve``: the same plan, restore, publish and simulated time). A route sends
each request, at its arrival, to:

- ``round-robin``: the next engine in turn;
- ``least-load``: the engine with the fewest requests running and waiting then (ties:
  fewer prompt tokens not yet prefilled, then the first in an order that turns by one
  each request, as the router's does: idle engines take turns rather than the first
  taking every request that finds them all idle);
- ``cache-aware``: ``costmodel.fleet.choose`` over what each engine's store holds of the
  prompt (``TieredStore.locate``: its L1 and L2, then the shared L3) and its queue, with
  the load bound ``max_imbalance``: the router's rule, its ties turning as least-load's.

An engine's load at a moment is what it was sent and has not finished: a request is
waiting or prefilling until its first token (its prompt tokens count as not yet
prefilled until then) and running until it has decoded its answer.

The shared L3 is written back (a page reaches it when an engine spills it) unless the
config says write-through (``ReplayConfig.l3_write_through``: each page an engine
publishes is queued for L3 at once, so the others find it at their next request);
``replay_routes`` can replay each route both ways.
"""

from __future__ import annotations

import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kvtier.tiers.hierarchy import TieredStore
from kvtier.tiers.page import PageKey
from kvtier.tiers.store_config import open_l3_of

from .fleet import Candidate, choose
from .profile import Profile
from .replay import Replay, ReplayConfig, ReplayResult, fast_tmp
from .trace import SyntheticPrompts, TraceRequest

ROUTES = ("round-robin", "least-load", "cache-aware")
MAX_IMBALANCE = 4  # cache-aware: requests more than the least loaded engine's before one is passed over


@dataclass
class FleetEngine:
    """One simulated engine: its store, when it is free, and what it was sent."""

    name: str
    store: TieredStore
    free_at: float = 0.0
    requests: int = 0
    prompt_tokens: int = 0
    _queue: deque[tuple[float, float, int]] = field(default_factory=deque)  # (first token, done, prompt)

    def sent(self, first_token_at: float, done_at: float, prompt_tokens: int) -> None:
        self._queue.append((first_token_at, done_at, prompt_tokens))
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.free_at = done_at

    def load(self, now: float) -> tuple[int, int]:
        """(requests running and waiting, prompt tokens not yet prefilled) at ``now``; ``now``
        never goes back (requests arrive in order), so finished ones are forgotten."""
        while self._queue and self._queue[0][1] <= now:
            self._queue.popleft()
        return len(self._queue), sum(n for first, _, n in self._queue if first > now)


Pages = tuple[list[PageKey], list[int]]  # a request's page keys and tokens (``SyntheticPrompts.pages``)
# (engines, the request's index, its arrival in simulated seconds, the request, its pages) -> its engine
Route = Callable[[Sequence[FleetEngine], int, float, TraceRequest, Pages], FleetEngine]


def round_robin(engines: Sequence[FleetEngine], i: int, now: float, request: TraceRequest, pages: Pages) -> FleetEngine:
    return engines[i % len(engines)]


def turned(engines: Sequence[FleetEngine], i: int) -> list[FleetEngine]:
    """The engines in an order that turns by one each request, as the router's: the first
    of equals (``min`` keeps it) is then a different engine each time."""
    turn = i % len(engines)
    return [*engines[turn:], *engines[:turn]]


def least_load(engines: Sequence[FleetEngine], i: int, now: float, request: TraceRequest, pages: Pages) -> FleetEngine:
    return min(turned(engines, i), key=lambda e: e.load(now))


def cache_aware(max_imbalance: int, profile: Profile, config: ReplayConfig) -> Route:
    """``costmodel.fleet.choose`` over each engine's own view of the prompt and its queue."""

    def route(engines: Sequence[FleetEngine], i: int, now: float, request: TraceRequest, pages: Pages) -> FleetEngine:
        keys, tokens = pages
        candidates = []
        for engine in turned(engines, i):
            load, pending = engine.load(now)
            candidates.append(Candidate(engine.name, tuple(engine.store.locate(keys, tokens)), pending, load, profile))
        placed = choose(candidates, request.input_length, config.page_size, config.page_bytes, max_imbalance)
        return next(e for e in engines if e.name == placed.backend)

    return route


def fleet_route(name: str, max_imbalance: int, profile: Profile, config: ReplayConfig) -> Route:
    """The route a ``--route`` name stands for."""
    if name == "round-robin":
        return round_robin
    if name == "least-load":
        return least_load
    if name == "cache-aware":
        return cache_aware(max_imbalance, profile, config)
    raise ValueError(f"no route {name!r}: one of {', '.join(ROUTES)}")


def replay_fleet(
    trace: Sequence[TraceRequest],
    config: ReplayConfig,
    profile: Profile,
    engines: int,
    route: str,
    max_imbalance: int = MAX_IMBALANCE,
    on_request: Callable[[], None] | None = None,
) -> dict:
    """Replay ``trace`` on ``engines`` engines sharing one L3, routed by ``route``: the row
    of that route in ``kvtier replay --engines``'s report."""
    if engines < 1:
        raise ValueError("a fleet has at least one engine")
    one = Replay(trace, config, profile)
    choose_engine = fleet_route(route, max_imbalance, profile, config)
    result = ReplayResult(config)
    with tempfile.TemporaryDirectory(prefix="kvtier-fleet-", dir=fast_tmp()) as tmp:
        store_config = one.store_config(Path(tmp))
        shared = open_l3_of(store_config)
        fleet = [
            FleetEngine(f"engine-{i}", one.new_store(replace(store_config, shared_l3=shared))) for i in range(engines)
        ]
        try:
            prompts = SyntheticPrompts(one.namespace)
            for i, request in enumerate(trace):
                pages = prompts.pages(request)
                engine = choose_engine(fleet, i, request.arrival_s / config.speed, request, pages)
                first, done = one.serve(engine.store, request, pages, engine.free_at, result)
                engine.sent(first, done, request.input_length)
                if on_request is not None:
                    on_request()
        finally:
            for engine in fleet:
                engine.store.close()
            shared.close()
    return fleet_report(route, result, fleet, max(e.free_at for e in fleet))


def fleet_report(route: str, result: ReplayResult, fleet: Sequence[FleetEngine], makespan_s: float) -> dict:
    """Reuse, prefill saved, TTFT percentiles and load spread (max / mean per engine)."""
    reused = result.prompt_tokens - result.sources["recomputed"]
    p50, p95, p99 = np.percentile(result.ttft_s, [50, 95, 99]) if result.ttft_s else (0.0, 0.0, 0.0)
    requests = [e.requests for e in fleet]
    tokens = [e.prompt_tokens for e in fleet]
    return {
        "route": route,
        "l3_write_through": result.config.l3_write_through,
        "engines": len(fleet),
        "requests": len(result.ttft_s),
        "prompt_tokens": result.prompt_tokens,
        "reused_ratio": reused / max(result.prompt_tokens, 1),
        "reused_tokens": reused,
        "sources": dict(result.sources),
        "prefill_seconds_saved": result.prefill_seconds_saved,
        "ttft_p50_s": float(p50),
        "ttft_p95_s": float(p95),
        "ttft_p99_s": float(p99),
        "makespan_s": makespan_s,
        "per_engine": {e.name: {"requests": e.requests, "prompt_tokens": e.prompt_tokens} for e in fleet},
        "requests_spread": spread(requests),
        "prompt_tokens_spread": spread(tokens),
    }


def spread(counts: Sequence[int]) -> float:
    """Max over mean: 1.0 is an even spread (and nothing at all), N all on one of N engines."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0


def replay_routes(
    trace: Sequence[TraceRequest],
    config: ReplayConfig,
    profile: Profile,
    engines: int,
    routes: Sequence[str],
    max_imbalance: int = MAX_IMBALANCE,
    on_request: Callable[[], None] | None = None,
    write_through: Sequence[bool] = (False,),
) -> dict:
    """The fleet replayed once per route and L3 write mode (``write_through``: write-back,
    write-through or both, in that order per route): the report ``kvtier replay --engines
    --json`` prints."""
    return {
        "requests": len(trace),
        "prompt_tokens": sum(r.input_length for r in trace),
        "engines": engines,
        "page_size": config.page_size,
        "page_bytes": config.page_bytes,
        "policy": config.label,
        "max_imbalance": max_imbalance,
        "profile": "calibrated" if profile.calibrated else "defaults",
        "routes": [
            replay_fleet(trace, replace(config, l3_write_through=w), profile, engines, r, max_imbalance, on_request)
            for r in routes
            for w in write_through
        ],
    }


def format_fleet(report: dict) -> str:
    """The report as a text table: one row per route, with each engine's requests."""
    labels = [f"{r['route']}+through" if r["l3_write_through"] else r["route"] for r in report["routes"]]
    width = max([12, *map(len, labels)])
    lines = [
        f"{report['requests']} requests, {report['prompt_tokens']} prompt tokens on {report['engines']} engines "
        f"sharing one L3, eviction {report['policy']}, cost model: {report['profile']}",
        "",
        f"{'route':<{width}} {'reused':>7} {'saved s':>9} {'ttft p50':>9} {'p95':>9} {'p99':>9} "
        f"{'req max/mean':>12} {'tok max/mean':>12}  requests per engine",
    ]
    for r, label in zip(report["routes"], labels):
        per_engine = " ".join(str(e["requests"]) for e in r["per_engine"].values())
        lines.append(
            f"{label:<{width}} {r['reused_ratio']:>7.1%} {r['prefill_seconds_saved']:>9.0f} {r['ttft_p50_s']:>9.2f} "
            f"{r['ttft_p95_s']:>9.2f} {r['ttft_p99_s']:>9.2f} {r['requests_spread']:>12.2f} "
            f"{r['prompt_tokens_spread']:>12.2f}  {per_engine}"
        )
    return "\n".join(lines)
