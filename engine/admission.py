"""Admission: at the moment a request leaves the queue, plan its restore, or hold it.

The plan is made from what the store holds now (matched again, not at enqueue: pages
may have moved meanwhile). With prefix single flight, a request whose next pages a
running request is computing may first wait for them (prefix single flight, DESIGN
§7), when the cost model prefers waiting (``costmodel.plan.plan_wait``); the
bookkeeping is ``engine.prefix_flights``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvtier.costmodel.plan import Profile, RestorePlan, plan_restore, plan_wait
from kvtier.tiers.hierarchy import TieredStore
from kvtier.tiers.page import PageGeometry, Source
from kvtier.tiers.quant import stored_nbytes

from .config import EngineConfig
from .request import Request
from .scheduler import Scheduler


def l1_tokens(matched: Sequence[Source], page_size: int) -> int:
    """Prompt tokens in the matched pages that L1 holds."""
    return sum(page_size for s in matched if s is Source.L1)


def hold_deadline(now: float, wait_s: float, first: float | None) -> float:
    """A held request's deadline (perf_counter) after a hold at ``now`` allowing ``wait_s``:
    set at its first hold and never extended, so a request waits a bounded time however
    often its leader changes; ``first`` is the deadline of an earlier hold, if any."""
    deadline = now + wait_s
    return deadline if first is None else min(deadline, first)


class Admission:
    """Plans each admitted request (``request.plan``), or holds it for pages in flight."""

    def __init__(
        self,
        store: TieredStore,
        scheduler: Scheduler,
        config: EngineConfig,
        geometry: PageGeometry,
        running: Mapping[int, Request],
        prefix_flight: bool,
        snapshot_at: Callable[[Request, int], None],
    ) -> None:
        self.store, self.scheduler, self.config, self.geometry = store, scheduler, config, geometry
        self.running = running  # the engine's running requests, read to find a leader's progress
        self.prefix_flight = prefix_flight
        self.snapshot_at = snapshot_at  # a running hybrid leader keeps its state after a page too
        self.stored_bytes = stored_nbytes(config.store.codec, geometry.nbytes, geometry.dtype)  # one L3 record

    def plan(self, request: Request, profile: Profile) -> list[Source] | None:
        """Plan ``request`` with ``profile`` and return the sources of its matched pages;
        None when it was held instead."""
        matched = self.store.locate(request.keys, request.prompt, request.l3_read)
        profile = profile.capped(self.config.store.throttle)
        if self.prefix_flight and self.hold_for_prefix(request, matched, profile):
            return None
        after = request.prompt[len(matched) * self.config.page_size : len(request.prompt) - 1]
        keys, parent = request.keys[: len(matched)], request.parents[len(matched)]
        points = self.store.restore_points(keys, after, parent, request.l3_read)
        request.plan = self.restore_plan(request, matched, profile, points)
        request.l1_tokens_at_admission = l1_tokens(matched, self.config.page_size)
        return matched

    def restore_plan(
        self, request: Request, matched: list[Source], profile: Profile, points: list[int] | None = None
    ) -> RestorePlan:
        """``costmodel.plan.plan_restore`` of ``request`` over the ``matched`` pages."""
        return plan_restore(
            matched,
            len(request.prompt),
            self.config.page_size,
            self.geometry.nbytes,
            profile,
            self.config.store.codec,
            points,
            self.geometry,
            snapshot_bytes=self.geometry.snapshot_nbytes,
            stored_bytes=self.stored_bytes,
        )

    def worth_reading(self, request: Request, resident: list[Source], profile: Profile) -> bool:
        """Whether L3 could change the plan: were every page after the ``resident`` ones in
        L3, the plan would restore some of them (a slow L3 is not even asked)."""
        rest = [Source.L3] * (len(request.keys) - len(resident))
        plan = self.restore_plan(request, resident + rest, profile.capped(self.config.store.throttle))
        return plan.restore_pages > len(resident)

    def hold_for_prefix(self, request: Request, matched: list[Source], profile: Profile) -> bool:
        """Hold ``request`` if its pages after the ``matched`` ones are being computed by
        a running request and the cost model prefers waiting for them. Its deadline is
        set at its first hold and never extended (``hold_deadline``). A hybrid model's
        leader keeps a snapshot at the end of the shared prefix, so the request restores
        all of it (a state cannot be cut), not only up to the leader's own snapshots."""
        leader, count = self.scheduler.in_flight(request.keys, len(matched))
        now = time.perf_counter()
        if leader is None or (
            request.wait_deadline is not None and now >= request.wait_deadline
        ):  # count is 0 without one
            return False
        lead = next(r for r in self.running.values() if r.rid == leader)
        size = self.config.page_size
        plan = plan_wait(
            matched,
            count,
            lead.prefix_tokens + lead.prefilled,
            len(request.prompt),
            size,
            self.geometry.nbytes,
            profile,
            self.config.store.codec,
            self.stored_bytes,
        )
        if not plan.wait:
            return False
        deadline = hold_deadline(now, plan.deadline_s, request.wait_deadline)
        request.wait_deadline = deadline
        request.waited_tokens = max(request.waited_tokens, count * size)
        request.t_held = now
        self.scheduler.hold_for_prefix(request, leader, request.keys[len(matched) + count - 1], deadline)
        if self.geometry.snapshot_nbytes:
            self.snapshot_at(lead, len(matched) + count)
        return True
