"""Restore-or-recompute plans priced with a cost profile (``costmodel.profile``) (DESIGN §6)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from kvtier.tiers.links import READ_LINKS, Link, links_crossed
from kvtier.tiers.page import PageGeometry, Source

from .profile import Profile


@dataclass
class RestorePlan:
    """How a prompt's matched pages are used.

    Pages ``[0, restore_pages)`` are not computed after the restore: the leading L1
    pages are used as they are, the next ``overlap_pages`` are computed while the
    pages after them, up to ``restore_pages``, load (Cake: compute walks forward,
    loads take the back); the rest of the prompt is computed after. With
    ``overlap_pages == 0`` the plan is serial: restore, then compute.
    """

    matched: list[str]  # tier of each matched page, in prompt order
    restore_pages: int
    predicted_s: float  # predicted time of the chosen plan
    recompute_s: float  # predicted prefill time with nothing restored
    overlap_pages: int = 0
    l1_pages: int = 0  # leading L1 pages

    @property
    def first_loaded(self) -> int:
        """Index of the first page loaded from the store after the leading L1 pages."""
        return self.l1_pages + self.overlap_pages

    def to_dict(self) -> dict:
        return {
            "matched": self.matched,
            "restore_pages": self.restore_pages,
            "overlap_pages": self.overlap_pages,
            "predicted_s": round(self.predicted_s, 6),
            "recompute_s": round(self.recompute_s, 6),
        }


class LoadCost:
    """Predicted time to bring any run of the matched pages into a request's KV, from
    per-link prefix sums of the bytes they would move (each link pays its setup once).

    ``window``: a sliding-window model's geometry. A restore of a prefix reads every
    page's global rows but the window rows only of the pages its window sees
    (``PageGeometry.window_pages``), so a page is priced at its global segment, and the
    window segments of those pages are added for the prefix that ends at ``stop``.

    ``stored_bytes``: what one page's record holds (None: ``page_bytes``), the bytes a
    compressed or quantized page moves on ``L3->L2``, whose fit prices its decode (the
    calibration measures that link with the store's own codec: ``costmodel.calibrate``);
    such a page is decoded whole, window rows included."""

    def __init__(
        self,
        matched: Sequence[Source],
        page_bytes: int,
        profile: Profile,
        codec: str = "raw",
        window: PageGeometry | None = None,
        stored_bytes: int | None = None,
    ) -> None:
        self.profile = profile
        self.window = window if window is not None and window.window is not None else None
        self.window_bytes = self.window.segments[1] if self.window is not None else 0
        each = page_bytes - self.window_bytes  # what every page of a restore moves
        whole = page_bytes if stored_bytes is None else stored_bytes  # a decoded page's record
        self.crossed = [links_crossed(source, codec) for source in matched]
        moved = {link: whole if link == Link.L3_L2 else each for c in self.crossed for link in c}  # per page
        self.prefix = {
            link: list(accumulate((nbytes * (link in c) for c in self.crossed), initial=0))
            for link, nbytes in moved.items()
        }
        self.joined = list(accumulate((each * (s is not Source.L1) for s in matched), initial=0))

    def seconds(self, start: int, stop: int, links: Sequence[str] | None = None) -> float:
        seen = [i for i in self.window.window_pages(stop) if i >= start] if self.window is not None else []
        return sum(
            self.profile.links[link].predict(
                sums[stop]
                - sums[start]
                + self.window_bytes * sum(link in self.crossed[i] for i in seen if link != Link.L3_L2)
            )
            for link, sums in self.prefix.items()
            if links is None or link in links
        )

    def overlapped(self, start: int, stop: int) -> tuple[float, float]:
        """(reads, join) of loading these pages beside the model: only the L3 reads
        (checks, decodes) run beside it; joining every page into the KV (priced as
        an L2->L1 copy) runs after it, on the model's thread. For a raw L3 page that
        counts its copy twice: a pessimism that keeps overlap for clear wins."""
        join = self.profile.links["L2->L1"].predict(self.joined[stop] - self.joined[start])
        return self.seconds(start, stop, READ_LINKS["L3"]), join


def snapshot_seconds(restored: Sequence[Source], snapshot_bytes: int, profile: Profile) -> float:
    """Reading the state snapshot that ends a hybrid restore of the ``restored`` pages:
    priced on the links of the last page's tier (the snapshot is kept beside its page:
    evicted with it and restored alike; raw in every tier); nothing for no pages."""
    if not restored or not snapshot_bytes:
        return 0.0
    return sum(profile.links[link].predict(snapshot_bytes) for link in links_crossed(restored[-1]))


def restore_seconds(
    sources: Sequence[Source], page_bytes: int, profile: Profile, codec: str = "raw", stored_bytes: int | None = None
) -> float:
    """Predicted time to bring these pages into a request's KV (``stored_bytes``: ``LoadCost``)."""
    return LoadCost(sources, page_bytes, profile, codec, stored_bytes=stored_bytes).seconds(0, len(sources))


def plan_restore(
    matched: Sequence[Source],
    prompt_tokens: int,
    page_size: int,
    page_bytes: int,
    profile: Profile,
    codec: str = "raw",
    points: Sequence[int] | None = None,
    window: PageGeometry | None = None,
    snapshot_bytes: int = 0,
    stored_bytes: int | None = None,
) -> RestorePlan:
    """The plan with the least predicted time to the end of prefill.

    For each restored prefix length ``k`` (at least up to the last L1 page: L1 pages
    are always used) it weighs the serial plan, restore then compute, against the
    overlapped one whose split balances computing the first pages against reading
    the others (the two times move in opposite directions, so a bisection finds it);
    the overlapped plan then joins what was read (see ``LoadCost.overlapped``).

    The pages loaded beside the model never include an L1 page (its bytes are device
    memory, read on the model's thread only), so a prefix with an L1 page after its
    leading L1 pages is restored serially.

    ``points``: the only prefix lengths (in pages) that can be restored, a hybrid
    model's restore points (``TieredStore.restore_points``); restored serially, and
    its L1 pages are used only when one is at or after them. None: every length.

    ``window``: a sliding-window model's geometry (``LoadCost``): its pages are priced at
    the bytes a restore reads, and it is restored serially. ``stored_bytes``: a page's
    record (``LoadCost``), when the codec compresses or quantizes.

    ``snapshot_bytes``: a hybrid model's state, read with a restore that ends at one of
    its ``points`` (``snapshot_seconds``), so a point whose snapshot is slow to read can
    lose to an earlier one.
    """
    loads = LoadCost(matched, page_bytes, profile, codec, window, stored_bytes)
    compute = profile.compute.predict
    l1 = [i for i, s in enumerate(matched) if s is Source.L1]
    lead = next((i for i, s in enumerate(matched) if s is not Source.L1), len(matched))
    next_l1 = next((i for i in l1 if i >= lead), len(matched))  # the loads stop before it
    recompute = compute(prompt_tokens, 0)
    best = RestorePlan([s.value for s in matched], 0, float("inf"), recompute, 0, lead)
    allowed = None if points is None else {0, *points}
    for k in range(l1[-1] + 1 if l1 and allowed is None else 0, len(matched) + 1):
        if allowed is not None and k not in allowed:
            continue
        rest = compute(prompt_tokens - k * page_size, k * page_size)
        options = [(loads.seconds(0, k) + rest + snapshot_seconds(matched[:k], snapshot_bytes, profile), 0)]
        serial = allowed is not None or loads.window is not None
        most = k - lead - 1 if k <= next_l1 and not serial else 0  # compute c pages while at least one loads
        if most >= 1:

            def front(c: int) -> float:
                return compute(c * page_size, lead * page_size)

            lo, hi = 1, most  # smallest c whose compute outlasts the reads beside it
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if front(mid) >= loads.overlapped(lead + mid, k)[0] else (mid + 1, hi)
            for c in {max(1, lo - 1), lo}:
                reads, join = loads.overlapped(lead + c, k)
                options.append((max(front(c), reads) + join + rest, c))
        seconds, c = min(options)
        if seconds < best.predicted_s:
            best = RestorePlan(best.matched, k, seconds, recompute, c, lead)
    return best


@dataclass
class WaitPlan:
    """Whether a request should wait for pages another request is computing right now.

    Times run from the decision. ``wait_s``: until the leader publishes the awaited
    pages; ``predicted_s``: to the end of this request's prefill if it waits (then
    restores them from L1 and computes the rest); ``recompute_s``: if it computes
    them now instead, beside the leader. ``deadline_s``: the longest it may wait and
    still do no worse than computing now: a waiter is released by then whatever
    the leader's progress.
    """

    wait: bool
    wait_s: float
    predicted_s: float
    recompute_s: float
    deadline_s: float


def plan_wait(
    stored: Sequence[Source],
    awaited_pages: int,
    leader_tokens: int,
    prompt_tokens: int,
    page_size: int,
    page_bytes: int,
    profile: Profile,
    codec: str = "raw",
    stored_bytes: int | None = None,
) -> WaitPlan:
    """Wait for ``awaited_pages`` pages after the ``stored`` ones, which a leader with
    ``leader_tokens`` tokens already in its cache is computing, or compute them now?

    On one device, computing now runs beside the leader: until the shorter of the
    two is done each goes at half speed, so computing now costs this request's own
    plan plus the leader's remaining work, up to the length of its own. Waiting costs
    the leader's remaining work, the restore of the awaited pages from L1 after the
    stored ones, and the rest of the prompt.
    """
    compute = profile.compute.predict
    ready = (len(stored) + awaited_pages) * page_size
    leader_left = compute(ready - leader_tokens, leader_tokens) if ready > leader_tokens else 0.0
    after = restore_seconds([*stored, *[Source.L1] * awaited_pages], page_bytes, profile, codec, stored_bytes)
    after += compute(prompt_tokens - ready, ready)
    own = plan_restore(stored, prompt_tokens, page_size, page_bytes, profile, codec, stored_bytes=stored_bytes)
    now = own.predicted_s + min(own.predicted_s, leader_left)
    waiting = leader_left + after
    return WaitPlan(waiting <= now, leader_left, waiting, now, max(now - after, 0.0))  # a tie waits: less work
