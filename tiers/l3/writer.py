"""The background writer every L3 backend holds: the queue of page writes, deletes of
rejected records and uses, drained in batches on one thread, off the request path.

The writer knows nothing of a backend's medium: it hands each batch to the ``commit``
its backend gives it, and a batch whose commit raises to ``lost`` (the batch is lost, not
the tier). Invariants:
- ``put`` never blocks unless asked to (``wait=True``): a full queue refuses the write.
- deletes of a batch are named by ``doomed`` until that batch has committed, so a
  rejected record reads as absent the whole time (see ``RecordCheck.doomed``, ``tiers.l3.check``).
- ``close`` commits all pending work before the thread stops; after it, ``put`` refuses.
- a read-only writer never starts its thread and refuses every write and delete;
- a use (``touch``) never wakes the thread: it rides along with the next batch (a
  write's, a delete's, a flush's) or is committed at the thread's next look
  (``_TOUCH_POLL_S``). Why: a restore touches every L3 page it serves, and waking
  another Python thread from the restore's costs it a GIL hand-over, on a busy
  machine as long as a small restore; uses are hints for L3's eviction order, which
  a write (the only thing that evicts) commits with them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from .record import Quantize

_TOUCH_DELAY_S = 0.05  # uses alone wait this long, so many share one commit
_TOUCH_POLL_S = 1.0  # an idle writer looks for uses this often (they do not wake it)
_MAX_TOUCHES = 4096  # uses are hints: past this many pending, the oldest are dropped


@dataclass
class PendingPut:
    key: bytes
    namespace: bytes
    tokens: bytes
    payload: bytes
    segments: tuple[int, ...] = ()  # byte lengths of the payload's segments (``record.encode_record``)
    quantize: Quantize | None = None  # how a quantized codec encodes this page (None: not a page, stored raw)
    parent: bytes | None = None  # the key of the page before it, when the writer knows it (leaf-first in L3)


@dataclass
class Batch:
    """Everything the writer commits at once."""

    puts: list[PendingPut]
    touches: list[bytes]
    deletes: dict[bytes, object]  # page key -> fingerprint of the bad value a read saw


@dataclass(frozen=True)
class WriterState:
    """A read-only view of the writer at one moment (for tests and diagnostics)."""

    queued_puts: int
    queued_touches: int
    queued_deletes: int
    committing: bool  # a batch is being committed now
    stopped: bool  # closed and drained (or read-only: never started)


class Writer:
    """The queue and the thread that drains it into ``commit``."""

    def __init__(
        self,
        commit: Callable[[Batch], None],
        lost: Callable[[Batch, Exception], None],
        *,
        queue_pages: int,
        readonly: bool,
    ) -> None:
        self._commit, self._lost = commit, lost
        self._queue_pages = max(1, queue_pages)
        self.readonly = readonly
        self._lock = threading.Lock()  # guards the pending work below
        self._wake = threading.Condition(self._lock)
        self._puts: dict[bytes, PendingPut] = {}
        self._touches: dict[bytes, None] = {}  # insertion order = access order
        self._deletes: dict[bytes, object] = {}
        self._deleting: frozenset[bytes] = frozenset()  # deletes of the batch being committed
        self._in_flight = self._closing = self._stopped = readonly
        self._flushers = 0
        self._accepted = self._settled = 0  # writes queued, and of them those whose batch has ended
        self._thread = threading.Thread(target=self._run, name="kvtier-l3-writer", daemon=True)

    def start(self) -> None:
        if not self.readonly:
            self._thread.start()

    def progress(self) -> tuple[int, int]:
        """(writes queued in all, those whose batch has ended: committed, skipped as
        stored, or lost): their difference is what a flush still waits for."""
        with self._lock:
            return self._accepted, self._settled

    def state(self) -> WriterState:
        with self._lock:
            return WriterState(len(self._puts), len(self._touches), len(self._deletes), self._in_flight, self._stopped)

    # --- caller threads ----------------------------------------------------------------

    def queued(self, key: bytes) -> bool:
        """A write of ``key`` waits in the queue."""
        return key in self._puts

    def put(self, pending: PendingPut, *, wait: bool) -> bool:
        """Queue a write; False when the queue is full (or closing). ``wait=True`` waits
        for room instead."""
        with self._lock:
            while wait and not self._closing and len(self._puts) >= self._queue_pages:
                self._wake.wait()
            if self._closing or len(self._puts) >= self._queue_pages:
                return False
            if pending.key not in self._puts:
                self._puts[pending.key] = pending
                self._accepted += 1
            self._wake.notify_all()
        return True

    def touch(self, key: bytes) -> None:
        """Record a use of ``key`` (the most recent last; the oldest dropped past a bound)."""
        with self._lock:
            self._touches.pop(key, None)
            self._touches[key] = None
            if len(self._touches) > _MAX_TOUCHES:
                del self._touches[next(iter(self._touches))]

    def delete(self, key: bytes, fingerprint: object) -> None:
        """Queue the delete of ``key`` while it still holds the value of ``fingerprint``."""
        if self.readonly:
            return
        with self._lock:
            self._deletes[key] = fingerprint
            self._wake.notify_all()

    def doomed(self, key: bytes) -> bool:
        """A delete of ``key`` is queued or being committed."""
        with self._lock:
            return key in self._deletes or key in self._deleting

    def flush(self) -> None:
        """Block until every queued write, delete and use is committed."""
        with self._lock:
            self._flushers += 1
            self._wake.notify_all()
            while (self._has_work() or self._in_flight) and not self._stopped:
                self._wake.wait()
            self._flushers -= 1

    def close(self) -> None:
        """Commit all pending work and stop the thread; idempotent."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # --- the writer thread ---------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._puts or self._touches or self._deletes)

    def _next_batch(self) -> Batch | None:
        with self._lock:
            while not self._has_work() and not self._closing:
                self._wake.wait(_TOUCH_POLL_S)  # uses do not wake it (module docstring)
            if not (self._puts or self._deletes or self._closing or self._flushers):
                self._wake.wait(_TOUCH_DELAY_S)  # only touches: let more arrive
            if not self._has_work():
                self._stopped = True  # closing and drained
                self._wake.notify_all()
                return None
            batch = Batch(list(self._puts.values()), list(self._touches), dict(self._deletes))
            self._puts, self._touches, self._deletes = {}, {}, {}
            self._deleting = frozenset(batch.deletes)
            self._in_flight = True
            return batch

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._commit(batch)
            except Exception as exc:  # the writer must survive: lose the batch, not the tier
                self._lost(batch, exc)
            finally:
                with self._lock:
                    self._in_flight = False
                    self._settled += len(batch.puts)
                    self._deleting = frozenset()
                    self._wake.notify_all()
