"""The side tables an L3 store keeps beside its records: meta entries (``put_meta``, e.g.
cost profiles), cumulative counters that every process adds into, and the namespaces
table (what each namespace is, for ``kvtier store ls``).

Every backend holds one (``L3Store.tables``). They are best effort: a backend error
never reaches the caller (a failed read is absent, a failed write is lost), logged once.
A damaged value (garbage bytes, or a well-formed value of the wrong shape) is one
warning (``DamageLog``) and a defined fallback, never an exception: counters count from
zero, a profile reads as absent (the engine recalibrates or uses its defaults), a
namespace row is rebuilt from the records (LMDB) or dropped (Redis, which cannot count).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TypeGuard

import msgpack

log = logging.getLogger(__name__)


def unpacked(stored: bytes | memoryview | None) -> tuple[bool, object]:
    """(readable, value) of a stored msgpack value; (True, None) when absent."""
    if stored is None:
        return True, None
    try:
        return True, msgpack.unpackb(bytes(stored))
    except Exception:  # msgpack raises ValueError subclasses, and others on some garbage
        return False, None


def is_count(value: object) -> TypeGuard[int]:
    """A whole number >= 0 (what the store's meta numbers are)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_counter_tree(value: object) -> TypeGuard[dict]:
    """A nested dict of names to numbers (cumulative counters)."""
    return isinstance(value, dict) and all(
        isinstance(name, str) and (is_counter_tree(v) or (isinstance(v, (int, float)) and not isinstance(v, bool)))
        for name, v in value.items()
    )


def is_namespace_row(value: object) -> TypeGuard[dict]:
    """A namespaces-table row: pages, bytes, tokens (counts), last_use (a time), about (a dict)."""
    return (
        isinstance(value, dict)
        and all(is_count(value.get(name)) for name in ("pages", "bytes", "tokens"))
        and isinstance(value.get("last_use"), (int, float))
        and isinstance(value.get("about"), dict)
    )


class DamageLog:
    """Damaged side values of one store, each reported once (a warning naming the store,
    the value and the fallback taken); later sightings of the same value are debug lines."""

    def __init__(self, location: str) -> None:
        self.location = location
        self._seen: set[str] = set()

    def report(self, what: str, fallback: str) -> None:
        level = logging.DEBUG if what in self._seen else logging.WARNING
        self._seen.add(what)
        log.log(level, "store %s: damaged %s; %s", self.location, what, fallback)


class SideTables(ABC):
    """Meta, cumulative counters and the namespaces table of one store."""

    @abstractmethod
    def get_meta(self, name: str) -> object | None:
        """The value ``put_meta`` stored under ``name``, None when absent or unreadable."""

    @abstractmethod
    def put_meta(self, name: str, value: object) -> None:
        """Store a msgpack-able value under ``name`` (replacing any)."""

    @abstractmethod
    def add_persistent_counters(self, delta: dict) -> None:
        """Add a nested dict of numbers into the stored cumulative counters (atomically:
        concurrent processes never lose an update)."""

    @abstractmethod
    def persistent_counters(self) -> dict:
        """The stored cumulative counters, a nested dict ({} when none)."""

    @abstractmethod
    def reset_counters(self) -> None:
        """Forget the cumulative counters (``kvtier stats --reset``)."""

    @abstractmethod
    def namespaces(self) -> dict[bytes, dict]:
        """Per namespace digest: pages, bytes, tokens, last_use (unix time) and what its
        writer said about it (``describe_namespace``)."""

    @abstractmethod
    def describe_namespace(self, digest: bytes, about: dict) -> None:
        """Record what a namespace is (model, page size, ...)."""
