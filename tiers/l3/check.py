"""The record check of an L3 store: every record a read finds is served only once its
header and checksum hold, else rejected: counted, its delete queued, and until that delete
commits its key reads as absent.

The check is the backends' one rule for serving records (``L3Store.check``); the
restore path (``tiers.restore``) asks it for each record it copies out of a snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from ..quant import decode
from .cipher import RecordCipher
from .record import CorruptRecord, StoredRecord, checked_record, record_bytes
from .writer import Writer

log = logging.getLogger(__name__)

Count = Callable[..., None]  # L3Store.count: add to the store's counters, thread-safe
Fingerprint = Callable[[memoryview | bytes], object]  # what identifies a bad value


class RecordCheck:
    """Serve or reject the records of one store.

    ``fingerprint`` names a bad value so that its delete spares a record rewritten
    meanwhile; ``tracks_use`` (a backend that does not see its own reads) has the writer
    record each hit as a use. With a ``cipher`` only encrypted records are served, once
    their tag holds; without one, no encrypted record is (``tiers.l3.record``).
    """

    def __init__(
        self,
        writer: Writer,
        fingerprint: Fingerprint,
        count: Count,
        *,
        tracks_use: bool,
        cipher: RecordCipher | None = None,
    ) -> None:
        self._writer, self._fingerprint, self._count = writer, fingerprint, count
        self._tracks_use, self._cipher = tracks_use, cipher

    def doomed(self, key: bytes) -> bool:
        """A read rejected this record and its delete has not committed yet.

        Such a key reads as absent, so a caller recomputes the page and may store it
        again at once (the writer commits deletes before puts); answering "present"
        would make put skip the fresh copy as already written.
        """
        return self._writer.doomed(key)

    def found(
        self, key: bytes, value: memoryview | bytes, namespace_digest: bytes, tokens: Sequence[int], raw_nbytes: int
    ) -> StoredRecord | None:
        """The record ``value`` holds if its header matches this page, else None (a bad
        header is rejected)."""
        try:
            return checked_record(key, value, namespace_digest, tokens, raw_nbytes, self._cipher is not None)
        except CorruptRecord as exc:
            self.reject(key, value, str(exc))
            return None

    def verified(self, record: StoredRecord, out: np.ndarray | None = None) -> memoryview | np.ndarray | bytes | None:
        """The record's raw bytes once its checksum holds; else None, and it is rejected.

        A raw payload comes back as the record's view itself (no copy) unless ``out`` is
        given; a compressed or quantized one is decoded into ``out`` (or new memory). Safe on any
        thread while the record's snapshot is open; counts the hit and the use.
        """
        try:
            raw = record_bytes(record, out, self._cipher, decode)
        except CorruptRecord as exc:
            self.reject(record.key, record.value, str(exc))
            return None
        self._hit(record)
        return raw

    def accept(self, record: StoredRecord, digest: int | tuple[int | None, ...]) -> bool:
        """Whether a raw record's payload, hashed by the caller while it copied it (the
        snapshot still open), matches its checksum; counted like ``verified``. A tuple
        holds the digests of the payload's segments, None for a segment not read."""
        try:
            if isinstance(digest, int):
                ok = digest == record.header.checksum  # found checked the length
            else:
                ok = all(d is None or d == record.segment_checksum(i) for i, d in enumerate(digest))
            reason = "checksum mismatch"
        except CorruptRecord as exc:
            ok, reason = False, str(exc)
        if not ok:
            self.reject(record.key, record.value, reason)
            return False
        self._hit(record)
        return True

    def reject(self, key: bytes, value: memoryview | bytes, reason: str) -> None:
        """A read found ``value`` of ``key`` bad: count it and queue its delete (spared if
        the record is rewritten meanwhile: the delete names this value's fingerprint, of
        its ``record.fingerprinted`` part, which a value read in part holds)."""
        log.warning("L3 record %s rejected (%s); deleting it", bytes(key).hex(), reason)
        fingerprint = self._fingerprint(value)
        self._count(checksum_failures=1)
        self._writer.delete(bytes(key), fingerprint)

    def _hit(self, record: StoredRecord) -> None:
        self._count(hit_pages=1, hit_tokens=record.header.token_count)
        if self._tracks_use:
            self._writer.touch(record.key)
