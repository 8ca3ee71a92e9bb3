"""The side tables an L3 store keeps beside its records: meta entries (``put_meta``, e.g.
cost profiles), cumulative counters that every process adds into, and the namespaces
table (what each namespace is, for ``kvtier store ls``).

Every backend holds one (``L3Store.tables``). They are best effort: a backend error
never reaches the caller (a failed read is absent, a failed write is lost), logged once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


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
