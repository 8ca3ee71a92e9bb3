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
from .lmdb_txn import Databases, ns_row
from .tables import SideTables

if TYPE_CHECKING:
    from .lmdb_txn import Database  # the stub's handle type: annotations only

log = logging.getLogger(__name__)

Failed = Callable[[str, BaseException, str], None]  # FailureLog.report: log once per kind


def _describe(row: dict) -> str:
    about = row.get("about") or {}
    return f"model {about.get('model', '?')}, page size {about.get('page_size', '?')}"


class LmdbTables(SideTables):
    """Side tables in an open environment (``namespaces`` None: a read-only store no
    writer has opened since that table came; it reads as empty)."""

    def __init__(self, path: Path, env: lmdb.Environment, dbs: Databases, failed: Failed) -> None:
        self.path = path
        self._env, self._meta, self._counters, self._namespaces = env, dbs.meta, dbs.counters, dbs.namespaces
        self._failed = failed

    def get_meta(self, name: str) -> object | None:
        return self._read(self._meta, b"user/" + name.encode())

    def put_meta(self, name: str, value: object) -> None:
        self._update(self._meta, b"user/" + name.encode(), lambda _: value)

    def add_persistent_counters(self, delta: dict) -> None:
        def add(stored: object) -> object:
            return add_into(stored if isinstance(stored, dict) else {}, delta)

        self._update(self._counters, b"cumulative", add)

    def persistent_counters(self) -> dict:
        stored = self._read(self._counters, b"cumulative")
        return stored if isinstance(stored, dict) else {}

    def reset_counters(self) -> None:
        with self._env.begin(write=True, db=self._counters) as txn:
            txn.drop(self._counters, delete=False)

    def namespaces(self) -> dict[bytes, dict]:
        if self._namespaces is None:
            return {}
        try:
            with self._env.begin(db=self._namespaces) as txn:
                return {bytes(k): msgpack.unpackb(v) for k, v in txn.cursor()}
        except Exception as exc:  # lmdb or msgpack: a damaged table reads as empty
            self._failed("namespaces read", exc, "")
            return {}

    def describe_namespace(self, digest: bytes, about: dict) -> None:
        """Record what a namespace is for ``kvtier store ls``; warn in one line when the
        store holds pages, none of them of this namespace."""

        def merge(row: object) -> dict:
            row = row if isinstance(row, dict) else ns_row()
            return {**row, "about": about}

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

    def _read(self, db: Database | None, key: bytes) -> object | None:
        try:
            with self._env.begin(db=db) as txn:
                stored = txn.get(key)
            return None if stored is None else msgpack.unpackb(stored)
        except Exception as exc:  # lmdb or msgpack: a damaged side entry reads as absent
            self._failed("side-table read", exc, f" ({key!r})")
            return None

    def _update(self, db: Database | None, key: bytes, change: Callable[[object], object]) -> None:
        try:
            with self._env.begin(write=True, db=db) as txn:
                stored = txn.get(key)
                old = None if stored is None else msgpack.unpackb(stored)
                txn.put(key, msgpack.packb(change(old)))
        except (lmdb.Error, ValueError) as exc:  # side tables are best effort
            self._failed("side-table write", exc, f" ({key!r})")
