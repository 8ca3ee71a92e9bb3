"""A Redis store's snapshot (``tiers.l3.redis_store``): lookups answered from values read
in a few pipelined rounds and kept in host memory until the snapshot ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import numpy as np

from .base import L3Store, Snapshot
from .record import RecordHeader, first_segment_end

BATCH_BYTES = 32 << 20  # a restore's MGET carries at most about this many bytes
HEAD = 16 << 10  # bytes first read of a record read in part: its header, for page sizes up to ~4,000 tokens


class RedisReads(Protocol):
    """What a snapshot asks its Redis store (``RedisTier``) to read."""

    def mget(self, keys: list[bytes]) -> list[bytes | None]: ...

    def ranges(self, spans: Sequence[tuple[bytes, int, int | None]], span_nbytes: int) -> list[bytes]: ...


class RedisSnapshot(Snapshot):
    """Lookups answered from batched reads: each value is read once, in an MGET of the
    expected keys that follow it, and kept (host memory) until the snapshot ends."""

    def __init__(self, store: L3Store, reads: RedisReads) -> None:
        super().__init__(store)
        self.reads = reads
        self._expected: dict[bytes, int] = {}
        self._order: list[bytes] = []
        self._window = 1
        self._values: dict[bytes, bytes | None] = {}

    def expect(self, keys: Sequence[bytes], raw_nbytes: int) -> None:
        self._order = list(keys)
        self._expected = {key: i for i, key in enumerate(self._order)}
        self._window = max(1, BATCH_BYTES // max(1, raw_nbytes))

    def _value(self, key: bytes) -> bytes | None:
        if key not in self._values:
            i = self._expected.get(key)
            batch = [key] if i is None else self._order[i : i + self._window]
            t0 = time.perf_counter()
            self._values.update(zip(batch, self.reads.mget(batch)))
            self.read_s += time.perf_counter() - t0
        return self._values.get(key)

    def read_ahead(
        self,
        keys: Sequence[bytes],
        raw_nbytes: int,
        run: bool = True,
        whole: Callable[[int], Collection[int]] | None = None,
    ) -> tuple[list[bytes], int]:
        """As ``Snapshot.read_ahead``; with ``whole``, in two pipelined rounds of
        ``GETRANGE``: every record's first ``HEAD`` bytes (its header; absent: none), then
        the rest of the records read whole and the first segment of the others, so what
        crosses the network is what a restore of the run joins."""
        if whole is None or not run:
            return super().read_ahead(keys, raw_nbytes, run)
        heads = self.reads.ranges([(key, 0, HEAD) for key in keys], HEAD)
        found: list[tuple[bytes, bytes]] = []
        for key, head in zip(keys, heads):
            if not head or self.store.check.doomed(key):
                break
            found.append((key, head))
        read_whole = set(whole(len(found)))
        ends = [None if i in read_whole else first_segment_end(head) for i, (_, head) in enumerate(found)]

        def unread(head: bytes, end: int | None) -> bool:
            """A value longer than its head, whose part to read (all, or to ``end``) goes past it."""
            return len(head) == HEAD and (end is None or end > HEAD)

        more = [i for i, (_, head) in enumerate(found) if unread(head, ends[i])]
        tails = dict(zip(more, self.reads.ranges([(found[i][0], HEAD, ends[i]) for i in more], raw_nbytes)))
        nbytes = 0
        for i, (key, head) in enumerate(found):
            value, end = head + tails.get(i, b""), ends[i]
            nbytes += len(value)
            if end is None:
                self._ahead[key] = value
                continue
            header, offset = RecordHeader.unpack(value)
            held = np.empty(offset + header.raw_len, np.uint8).data  # the rest: by ``complete``, if asked
            held[:end] = value[:end]
            self._ahead[key], self._partial[key] = held, (b"", held, end)
        self.read_s, self._only_ahead = 0.0, True
        return [key for key, _ in found], nbytes

    def complete(self, keys: Collection[bytes]) -> None:
        parts = [(bytes(k), self._partial.pop(bytes(k))) for k in keys if bytes(k) in self._partial]
        largest = max((len(held) for _, (_, held, _) in parts), default=0)
        tails = self.reads.ranges([(key, upto, None) for key, (_, _, upto) in parts], largest)
        for (_, (_, held, upto)), tail in zip(parts, tails):
            if len(tail) == len(held) - upto:  # else the record changed or went: its check rejects it
                held[upto:] = tail
