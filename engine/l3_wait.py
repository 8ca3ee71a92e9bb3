"""Requests waiting for their L3 pages, read off the step loop (DESIGN §7, §9).

At admission, a request whose stored prefix may go on past what L1 and L2 hold (the
store has an L3), or, on a hybrid model, whose pages L1 and L2 hold may be restored
further with a snapshot that only L3 holds (``tiers.snapshots``), is parked: its L3
records (pages and snapshots) are read on the store's reader threads
(``TieredStore.read_ahead``) while the step loop goes on with the other requests. A
read done by its deadline sends the request back to admission, which plans and
restores from what was read: the restore asks L3 nothing. The deadline is when
recomputing those pages would have finished (the cost model's prefill time of the
prompt's tokens after its resident pages, or after a hybrid's last resident restore
point, from the moment it was parked); past it the
read is abandoned (counted in the store's ``reads_abandoned``; it holds no pin, and its
snapshot ends whenever it completes) and the request is admitted to recompute them, L3
not asked again. L3 is not asked at all when the plan would not restore from it even
if it held every page after the resident ones (a slow link). Parked requests are held
by the scheduler, so they count as pending. With nothing running, requests whose reads
are done wait a moment (``EngineConfig.join_wait_s``) for the reads of the others still
in time: started apart, mlx-lm's ``BatchGenerator`` pads a late request's first prefill
chunk and the rest of the others' prompts to one length (``bench/engine_overhead.py``
shows what a burst of unique prompts pays for it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.costmodel.plan import Profile
from kvtier.tiers.hierarchy import TieredStore
from kvtier.tiers.l3_reads import nothing_read
from kvtier.tiers.page import Source

from .request import Request
from .scheduler import Scheduler

_IDLE_WAIT_S = 0.05  # the longest the idle step loop sleeps between looks at its parked reads


class L3Wait:
    """The parked requests and their reads."""

    def __init__(self, store: TieredStore, scheduler: Scheduler, page_size: int, join_wait_s: float) -> None:
        self.store, self.scheduler, self.page_size = store, scheduler, page_size
        self.join_wait_s = join_wait_s  # how long finished reads wait for the others when idle
        self._parked: dict[int, Request] = {}
        self._held_since: float | None = None  # when finished reads began waiting for the others (idle)

    def park(self, request: Request, profile: Profile, worth: Callable[[list[Source]], bool]) -> bool:
        """Start reading ``request``'s L3 pages (and a hybrid's snapshots after its last
        resident restore point) and hold it; False when there is nothing to read (no L3,
        read already, every page resident with its state, or L3 would not be restored
        from even if it held every other page: ``worth`` of the resident pages)."""
        if request.l3_read is not None:
            return False
        request.l3_read = nothing_read()
        if self.store.disk is None:
            return False
        matched = self.store.locate(request.keys, request.prompt, request.l3_read)
        resident = len(matched)
        pages = request.keys[resident:] if resident < len(request.keys) and worth(matched) else []
        start = self._restorable(request, resident)
        done = start * self.page_size
        deadline = time.perf_counter() + profile.compute.predict(len(request.prompt) - done, done)
        states = request.keys[start : resident + len(pages)]  # a hybrid's snapshots that could restore more
        read = self.store.read_ahead(pages, deadline, self._wake, states, first=resident)
        if read is None:
            return False
        request.l3_read = read
        self._parked[request.rid] = request
        self.scheduler.park(request)
        return True

    def _restorable(self, request: Request, resident: int) -> int:
        """How many of the ``resident`` pages could be restored without L3: all of them,
        but for a hybrid model only up to its last snapshot (or partial page with its
        state) that L1 or L2 holds."""
        size, keys = self.page_size, request.keys[:resident]
        after = request.prompt[resident * size : len(request.prompt) - 1]
        points = self.store.restore_points(keys, after, request.parents[resident], nothing_read())
        return resident if points is None else max(points, default=0)

    def poll(self, idle: bool = False) -> None:
        """Send back to admission the parked requests whose read is done, and those whose
        deadline has passed (their read abandoned: they recompute). ``idle`` (nothing
        running): the finished ones wait for the reads still running in time, up to
        ``join_wait_s``, so that a burst of requests starts as one batch."""
        now = time.perf_counter()
        reads = {rid: request.l3_read for rid, request in self._parked.items()}
        done = {rid for rid, read in reads.items() if read is not None and read.done()}
        late = {rid for rid, read in reads.items() if rid not in done and read is not None and now >= read.deadline}
        hold = idle and bool(done) and len(done) + len(late) < len(reads)
        if hold:
            self._held_since = now if self._held_since is None else self._held_since
            hold = now - self._held_since < self.join_wait_s
        if not hold:
            self._held_since = None
        for rid in late if hold else done | late:
            request = self._parked.pop(rid)
            read = request.l3_read
            assert read is not None, "a parked request without its read"
            if rid in late:
                self.store.readers.abandon(read)
                request.l3_read = nothing_read()
            self.scheduler.unpark(request)

    def wait(self) -> None:
        """With nothing running, sleep until a read completes, a request arrives or the
        next deadline passes (never on the I/O itself)."""
        if not self._parked:
            return
        now = time.perf_counter()
        deadline = min(r.l3_read.deadline for r in self._parked.values() if r.l3_read is not None)
        if self._held_since is not None:  # finished reads wait for the others until then
            deadline = min(deadline, self._held_since + self.join_wait_s)
        with self.scheduler.arrived:
            if not all(r.l3_read is not None and r.l3_read.done() for r in self._parked.values()):
                self.scheduler.arrived.wait(max(0.0, min(deadline - now, _IDLE_WAIT_S)))

    def ended(self, request: Request) -> None:
        """``request`` is admitted with its restore done, or has ended: its read's
        snapshot ends (abandoned while still running)."""
        read, request.l3_read = request.l3_read, None
        if self._parked.pop(request.rid, None) is not None and read is not None and not read.done():
            self.store.readers.abandon(read)
        elif read is not None:
            self.store.readers.end(read)

    def _wake(self) -> None:
        with self.scheduler.arrived:
            self.scheduler.arrived.notify_all()

    def __len__(self) -> int:
        return len(self._parked)
