"""A store's persisted counters, kept up to date while a process runs.

A store persists the counters that only grow (``StoreStats.cumulative``, and the
engine's beside them) by adding each process's delta to what earlier processes left
(``SideTables.add_persistent_counters``). A process that closes adds its whole run;
one that is killed (SIGKILL, the OOM killer, a power cut) never closes, so a serving
process checkpoints every few seconds and a kill loses at most that window.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .l3.tables import SideTables

log = logging.getLogger(__name__)

COUNTERS_EVERY_S = 10.0  # what a killed process can lose, at most, of its counters


class CounterCheckpoints:
    """What this process has added to a store's counters.

    Invariant: ``_written`` is the sum of every delta written; each write adds
    ``now - _written`` and makes ``_written = now``, so every count reaches the store
    exactly once, by a checkpoint or at close. After the first write (which gives the
    store every counter's name, zeros included), a write that would add nothing is
    skipped: an idle process writes nothing. The caller serialises writes (the store's
    lock)."""

    def __init__(self, tables: SideTables) -> None:
        self._tables = tables
        self._written: dict = {}

    def write(self, now: dict) -> None:
        delta = _minus(now, self._written)
        if _nonzero(delta) or not self._written:
            self._tables.add_persistent_counters(delta)
        self._written = now


def repeat(
    every_s: float, stop: threading.Event, work: Callable[[], None], what: str = "counters checkpoint"
) -> threading.Thread:
    """Run ``work`` every ``every_s`` seconds in a daemon thread until ``stop`` is set; a
    failure is one warning naming ``what``, and the next round tries again."""

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                work()
            except Exception as err:  # a store fault must not end the rounds
                log.warning("%s failed: %s", what, err)

    thread = threading.Thread(target=loop, name=f"kvtier {what}", daemon=True)
    thread.start()
    return thread


def _minus(total: dict, part: dict) -> dict:
    """``total - part`` for nested dicts of numbers (what ``part`` lacks counts from 0)."""
    return {
        name: _minus(value, part.get(name, {})) if isinstance(value, dict) else value - part.get(name, 0)
        for name, value in total.items()
    }


def _nonzero(delta: dict) -> bool:
    return any(_nonzero(v) if isinstance(v, dict) else v != 0 for v in delta.values())
