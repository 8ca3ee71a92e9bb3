"""Which record of an LMDB store follows which: what leaf-first eviction in L3 needs
(DESIGN §4, invariant 9).

A page is usable only while every page before it is found too (``tiers.page``: a key
names its whole prefix), so L3 never evicts a record while a stored record follows it:
the pages of a chain leave last page first, and every record L3 keeps is reachable
from the records before it. Keys do not say which key came before them, so a writer
that knows it gives the parent with the page (``L3Store.put(parent=...)``) and this
table keeps it beside the record, not in the record format.

The ``chain`` database holds two kinds of entries, both changed in the transaction
that stores or removes the record:
- ``b"p" + key -> parent key``: the stored record ``key`` follows page ``parent``;
- ``b"c" + parent -> u32``: how many stored records follow ``parent``, whether or not
  ``parent`` is stored itself (pages usually reach L3 last page first: L2 spills its
  leaves first, so a parent often arrives after its followers).

Invariant (kept by ``tiers.l3.lmdb_txn.PageTables``): a stored record is in ``order``,
an eviction candidate, exactly when no stored record follows it. A record written
without a parent (a chain's first page, a writer that did not know, a store from before
this table) follows nothing; its followers still hold it.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import lmdb

if TYPE_CHECKING:
    from lmdb import _Database as Database  # the stub's handle type: annotations only

_COUNT = struct.Struct("<I")
_PARENT, _FOLLOWERS = b"p", b"c"


class Chain:
    """The parent of each stored record and the count of stored records following each
    page, in one store's ``chain`` database (None: a read-only store no writer has opened
    since the table came; it knows no relation and is never written)."""

    def __init__(self, db: Database | None) -> None:
        self.db = db

    def followers(self, txn: lmdb.Transaction, key: bytes) -> int:
        """How many stored records follow page ``key``."""
        if self.db is None:
            return 0
        stored = txn.get(_FOLLOWERS + key, db=self.db)
        return _COUNT.unpack(bytes(stored))[0] if stored is not None and len(stored) == _COUNT.size else 0

    def link(self, txn: lmdb.Transaction, key: bytes, parent: bytes) -> bool:
        """Record that the record ``key``, just stored, follows ``parent``; True when
        ``parent`` had no follower before (it stops being an eviction candidate)."""
        assert self.db is not None, "a writable store opens its chain table"
        txn.put(_PARENT + key, parent, db=self.db)
        n = self.followers(txn, parent)
        txn.put(_FOLLOWERS + parent, _COUNT.pack(n + 1), db=self.db)
        return n == 0

    def unlink(self, txn: lmdb.Transaction, key: bytes) -> bytes | None:
        """Forget the record ``key`` (removed): its parent when that lost its last
        follower (it becomes an eviction candidate again), else None."""
        if self.db is None or (stored := txn.get(_PARENT + key, db=self.db)) is None:
            return None
        parent = bytes(stored)
        txn.delete(_PARENT + key, db=self.db)
        n = self.followers(txn, parent)
        if n > 1:
            txn.put(_FOLLOWERS + parent, _COUNT.pack(n - 1), db=self.db)
            return None
        txn.delete(_FOLLOWERS + parent, db=self.db)
        return parent
