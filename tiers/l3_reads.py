"""L3 reads off the engine's step loop: a small pool of reader threads beside the
writer thread (DESIGN §7).

A read ahead (``TieredStore.read_ahead``) opens one L3 snapshot on a reader thread and
reads there the records of a run of page keys (Redis: its batched ``MGET`` s; LMDB: in
its read transaction, each copied out of the map, so the step loop never faults on the
disk: ``_LmdbSnapshot._owned``), waiting out an L3 throttle too; the restore that follows on the
step loop (``begin``/``restore`` with ``read=``) finds them in memory and asks L3
nothing, and asks nothing past them (a page the read did not find is a miss).

Invariants:
- a read holds no pin and no store lock: pins are taken by the restore that uses it, on
  the step loop, so a read abandoned at its deadline (``abandon``: its caller recomputes
  instead) releases nothing but its snapshot, which ends whenever the read completes;
- every read's snapshot ends exactly once: by ``end`` (done: used or not), or by the
  read itself once abandoned;
- while a read has run past its deadline and not completed, L3 is stalled
  (``stalled``): the store reports itself degraded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field

from .l3.base import L3Store, Snapshot
from .links import Throttle
from .page import PageKey

READERS = 2  # reader threads: a restore's reads are batched, so a few suffice


@dataclass(eq=False)
class AheadRead:
    """One read ahead: the page keys asked for, a hybrid model's snapshot keys
    (``states``), its deadline (perf_counter), and once it has run the snapshot holding
    what it found."""

    keys: list[PageKey]
    deadline: float
    states: list[PageKey] = field(default_factory=list)
    future: Future[tuple[list[PageKey], list[PageKey]]] | None = None  # (pages, states) found; None: nothing read
    snapshot: Snapshot | None = None
    stack: ExitStack = field(default_factory=ExitStack)

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def _result(self) -> tuple[list[PageKey], list[PageKey]]:
        future = self.future
        if future is None or not future.done() or future.cancelled() or future.exception() is not None:
            return [], []
        return future.result()

    @property
    def found(self) -> list[PageKey]:
        """The leading page keys with a record (none until done, or when it failed)."""
        return self._result()[0]

    @property
    def found_states(self) -> frozenset[PageKey]:
        """The snapshot keys with a record (none until done, or when it failed)."""
        return frozenset(self._result()[1])


def nothing_read() -> AheadRead:
    """A read of nothing: a restore with it asks L3 nothing (after an abandoned read)."""
    return AheadRead([], 0.0)


class Readers:
    """The reader threads, and the reads in flight (to tell a stalled L3)."""

    def __init__(self, throttle: Throttle) -> None:
        self.throttle = throttle
        self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="kvtier-l3-read")
        self._lock = threading.Lock()
        self._in_flight: set[AheadRead] = set()
        self._abandoned: set[AheadRead] = set()
        self.abandoned = 0  # reads abandoned at their deadline, in all

    def start(
        self,
        disk: L3Store,
        keys: Sequence[PageKey],
        raw_nbytes: int,
        deadline: float,
        done: Callable[[], None],
        states: Sequence[PageKey] = (),
        state_nbytes: int = 0,
        whole: Callable[[int], Collection[int]] | None = None,
    ) -> AheadRead:
        """Read the run of ``keys`` and each of ``states`` (snapshot keys, of
        ``state_nbytes``) on a reader thread; ``done()`` is called when it completes.
        ``whole``: which of a run's records are read whole (``Snapshot.read_ahead``)."""
        read = AheadRead(list(keys), deadline, list(states))
        with self._lock:
            self._in_flight.add(read)
        read.future = self._pool.submit(self._read, disk, read, raw_nbytes, state_nbytes, whole)
        read.future.add_done_callback(lambda _: self._completed(read, done))
        return read

    def _read(
        self,
        disk: L3Store,
        read: AheadRead,
        raw_nbytes: int,
        state_nbytes: int,
        whole: Callable[[int], Collection[int]] | None,
    ) -> tuple[list[PageKey], list[PageKey]]:
        t0 = time.perf_counter()
        snapshot = read.snapshot = read.stack.enter_context(disk.snapshot())
        pages, nbytes = snapshot.read_ahead(read.keys, raw_nbytes, whole=whole)
        states, more = snapshot.read_ahead(read.states, state_nbytes, run=False) if read.states else ([], 0)
        snapshot.ahead_s = self.throttle.wait("L3", nbytes + more, time.perf_counter() - t0) if nbytes + more else 0.0
        return read.keys[: len(pages)], [PageKey(key) for key in states]  # pages: a leading run

    def _completed(self, read: AheadRead, done: Callable[[], None]) -> None:
        with self._lock:
            self._in_flight.discard(read)
            abandoned = read in self._abandoned
            self._abandoned.discard(read)
        if abandoned:
            read.stack.close()
        done()

    def abandon(self, read: AheadRead) -> None:
        """Stop waiting for ``read`` (past its deadline): counted; its snapshot ends when
        it completes (now, if it has)."""
        with self._lock:
            self.abandoned += 1
            if read in self._in_flight:
                self._abandoned.add(read)
                return
        read.stack.close()

    def end(self, read: AheadRead) -> None:
        """End a done read's snapshot, once its restore is finished (or it went unused)."""
        read.stack.close()

    def stalled(self) -> bool:
        """Some read has run past its deadline and not completed."""
        now = time.perf_counter()
        with self._lock:
            return any(now > read.deadline for read in self._in_flight)

    def close(self) -> None:
        """Stop the threads without waiting for a stalled read (it ends on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def degraded(readers: Readers, disk: L3Store | None, joining: bool) -> list[str]:
    """["L3"] while a read has run past its deadline, while L3's server backs off after a
    failure, or while a store unreachable at start has not joined yet (``joining``)."""
    late = disk is None and joining
    down = disk is not None and (readers.stalled() or not disk.reachable())
    return ["L3"] if late or down else []
