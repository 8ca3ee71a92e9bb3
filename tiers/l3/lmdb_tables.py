"""The side tables of an LMDB store (``tiers.l3.tables``): the ``meta`` database's
``user/`` entries, the ``counters`` database and the ``namespaces`` database.

Each call is one LMDB transaction of its own on a caller thread; LMDB serialises them
with the writer's. The write transaction adds page counts into the namespaces table
itself (``tiers.l3.lmdb_txn``); here a row's ``about`` is set and the table read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb
import msgpack

from ..counters import add_into
from .lmdb_meta import ns_row
from .lmdb_txn import PageTables
from .tables import SideTables, is_counter_tree, is_namespace_row, unpacked

if TYPE_CHECKING:
    from .lmdb_txn import Database  # the stub's handle type: annotations only

log = logging.getLogger(__name__)

Failed = Callable[[str, BaseException, str], None]  # FailureLog.report: log once per kind


def _describe(row: dict) -> str:
    about = row.get("about") or {}
    return f"model {about.get('model', '?')}, page size {about.get('page_size', '?')}"


class LmdbTables(SideTables):
    """Side tables in an open environment (``namespaces`` None: a read-only store no
    writer has opened since that table came; it reads as empty). A damaged value is one
    warning and its fallback (``tiers.l3.tables``); a writable store is repaired."""

    def __init__(self, path: Path, tables: PageTables, failed: Failed, *, readonly: bool) -> None:
        self.path = path
        dbs = tables.dbs
        self._env, self._meta, self._counters, self._namespaces = tables.env, dbs.meta, dbs.counters, dbs.namespaces
        self._rows, self._damage = tables.meta, tables.damage
        self._failed, self._readonly = failed, readonly

    def get_meta(self, name: str) -> object | None:
        return self._read(self._meta, b"user/" + name.encode(), f"meta entry {name}", "read as absent")

    def put_meta(self, name: str, value: object) -> None:
        self._update(self._meta, b"user/" + name.encode(), lambda _: value)

    def add_persistent_counters(self, delta: dict) -> None:
        damaged = ("cumulative counters", "counting from zero")

        def add(stored: object) -> object:
            if stored is not None and not is_counter_tree(stored):
                self._damage.report(*damaged)
                stored = None
            return add_into(stored if isinstance(stored, dict) else {}, delta)

        self._update(self._counters, b"cumulative", add, damaged)

    def persistent_counters(self) -> dict:
        damaged = ("cumulative counters", "counting from zero")
        stored = self._read(self._counters, b"cumulative", *damaged)
        if stored is not None and not is_counter_tree(stored):
            self._damage.report(*damaged)
            return {}
        return stored if isinstance(stored, dict) else {}

    def reset_counters(self) -> None:
        if self._readonly:
            return
        try:
            with self._env.begin(write=True, db=self._counters) as txn:
                txn.drop(self._counters, delete=False)
        except lmdb.Error as exc:
            self._failed("side-table write", exc, " (counters)")

    def namespaces(self) -> dict[bytes, dict]:
        """The namespaces table; a damaged row: the table as the records say it is
        (rewritten so, on a writable store)."""
        if self._namespaces is None:
            return {}
        try:
            with self._env.begin(db=self._namespaces) as txn:
                rows = {bytes(k): unpacked(v) for k, v in txn.cursor()}
                sound = {digest: row for digest, (readable, row) in rows.items() if readable and is_namespace_row(row)}
                if len(sound) == len(rows):
                    return sound
                self._damage.report("namespaces table", "rebuilt from the records")
                if self._readonly:
                    return self._rows.rebuilt_namespaces(txn, self._namespaces)
            with self._env.begin(write=True) as txn:
                self._rows.rebuild_namespaces(txn, self._namespaces)
                return self._rows.rebuilt_namespaces(txn, self._namespaces)
        except lmdb.Error as exc:
            self._failed("namespaces read", exc, "")
            return {}

    def describe_namespace(self, digest: bytes, about: dict) -> None:
        """Record what a namespace is for ``kvtier store ls``; warn in one line when the
        store holds pages, none of them of this namespace."""

        def merge(row: object) -> dict:
            return {**(row if is_namespace_row(row) else ns_row()), "about": about}

        self.namespaces()  # a damaged table is rebuilt first
        self._update(self._namespaces, digest, merge)
        others = {d: row for d, row in self.namespaces().items() if d != digest and row["pages"]}
        if others and not self.namespaces().get(digest, {}).get("pages"):
            seen = sorted({_describe(row) for row in others.values()})
            log.warning(
                "store %s holds no pages for this model and page size (%s), only %d of "
                "other namespaces (%s): nothing here will be reused",
                self.path,
                _describe({"about": about}),
                sum(r["pages"] for r in others.values()),
                "; ".join(seen),
            )

    def _read(self, db: Database | None, key: bytes, what: str, fallback: str) -> object | None:
        try:
            with self._env.begin(db=db) as txn:
                readable, value = unpacked(txn.get(key))
        except lmdb.Error as exc:
            self._failed("side-table read", exc, f" ({key!r})")
            return None
        if not readable:
            self._damage.report(what, fallback)
        return value

    def _update(
        self, db: Database | None, key: bytes, change: Callable[[object], object], damaged: tuple[str, str] = ("", "")
    ) -> None:
        """Replace the value under ``key`` by ``change(old)`` (old None: absent, or
        damaged: warned about as ``damaged``, what and fallback, when given). Nothing on a
        read-only store (its opening said that writes are dropped)."""
        if self._readonly:
            return
        try:
            with self._env.begin(write=True, db=db) as txn:
                readable, old = unpacked(txn.get(key))
                if not readable and damaged[0]:
                    self._damage.report(*damaged)
                txn.put(key, msgpack.packb(change(old)))
        except (lmdb.Error, ValueError, TypeError) as exc:  # side tables are best effort
            self._failed("side-table write", exc, f" ({key!r})")
