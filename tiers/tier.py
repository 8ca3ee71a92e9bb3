"""L1 (device) and L2 (host RAM) tiers: bounded LRU indexes of pages.

Invariants kept here:
- Capacity is a hard cap: ``bytes_used <= capacity`` at every moment; ``add``
  refuses a page that does not fit (the caller makes room first).
- ``victim`` only ever names an unpinned page, in the order of the tier's
  ``EvictionPolicy`` (least recently used first by default), so a pinned page is
  never evicted; with ``needed`` set (leaf-first: ``tiers.lineage``), it passes over a
  page still needed by a page after it, telling the policy (``EvictionPolicy.kept``),
  and names none when every unpinned page is needed (the page wanting room then goes
  elsewhere, as when every page is pinned).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import mlx.core as mx
import numpy as np

from .counters import TierStats
from .layout import slot_arena
from .page import PageKey
from .policy import EvictionPolicy
from .quant import PageCodec

Entry = TypeVar("Entry", "DevicePage", "HostPage")


@dataclass(frozen=True)
class TierView:
    """A tier's state at one moment, read-only (what tests and reports assert on)."""

    name: str
    pages: int  # indexed pages
    max_pages: int  # the cap, in pages
    bytes_used: int
    follower_parents: int = 0  # L1: parents in the index of pages by their previous page
    follower_pages: int = 0  # L1: pages in that index (every L1 page with a known parent)
    free_slots: int = 0  # L2: arena slots neither filled nor reserved


class Tier(Generic[Entry]):
    """Index of same-sized pages with a hard byte cap; ``page_nbytes`` is what one page
    counts against it (a trace replay counts full-size pages holding tiny payloads)."""

    def __init__(self, name: str, capacity: int, page_nbytes: int, policy: EvictionPolicy | None = None) -> None:
        self.name = name
        self.page_nbytes = page_nbytes
        self.max_pages = capacity // page_nbytes
        self.entries: OrderedDict[PageKey, Entry] = OrderedDict()
        self.policy = policy or EvictionPolicy()
        self.counters = TierStats(capacity=capacity)  # replaced at each change: see tiers.counters
        # told (tier, key, tokens in the page, stored or not) of every page indexed or dropped:
        # the one place a page's tier changes (``tiers.residency``)
        self.on_change: Callable[[str, PageKey, int, bool], None] | None = None
        self.needed: Callable[[PageKey], bool] | None = None  # leaf-first: see ``victim``

    def __contains__(self, key: PageKey) -> bool:
        return key in self.entries

    def __iter__(self) -> Iterator[PageKey]:
        return iter(list(self.entries))

    def get(self, key: PageKey) -> Entry | None:
        """The entry, marked most recently used; None when absent."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.policy.used(key)
        return entry

    def has_room(self) -> bool:
        return len(self.entries) < self.max_pages

    def victim(self, pinned: Callable[[PageKey], bool]) -> PageKey | None:
        """The policy's next unpinned page that no later page needs (``needed``); None when
        every page is pinned or needed. Each needed page passed over is ordered as the
        policy orders a kept one, so the search moves on (at most once round the tier)."""
        for _ in range(len(self.entries)):
            key = self.policy.victim(pinned)
            if key is None or self.needed is None or not self.needed(key):
                return key
            self.policy.kept(key)
        return None

    def add(self, key: PageKey, entry: Entry, cost: float = 1.0) -> None:
        if len(self.entries) >= self.max_pages:
            raise MemoryError(f"{self.name} is full")
        self.entries[key] = entry
        self.policy.added(key, cost)
        self.counters = self.counters.plus(inserts=1)
        self._update_gauges()
        if self.on_change is not None:
            self.on_change(self.name, key, len(entry.tokens), True)

    def mark_in_l3(self, key: PageKey) -> None:
        """Note on ``key``'s entry that L3 holds it (or its write is queued): moving down
        it is then never queued for L3 again, and nobody asks L3. Recency unchanged."""
        if key in self.entries:
            self.entries[key] = replace(self.entries[key], in_l3=True)

    def pop(self, key: PageKey) -> Entry:
        entry = self.entries.pop(key)
        self.policy.removed(key)
        self._update_gauges()
        if self.on_change is not None:
            self.on_change(self.name, key, len(entry.tokens), False)
        return entry

    def view(self) -> TierView:
        return TierView(self.name, len(self.entries), self.max_pages, self.counters.bytes_used)

    def _update_gauges(self) -> None:
        self.counters = replace(self.counters, pages=len(self.entries), bytes_used=len(self.entries) * self.page_nbytes)


@dataclass(frozen=True)
class DevicePage:
    """An L1 page: its token ids, one mx array of shape ``geometry.shape`` (a partial
    page: fewer tokens along axis 3) and the key of the page before it (None: unknown).
    ``in_l3``: L3 is known to hold it (restored from L3, or written there by this
    process), so it leaves the in-process tiers without an L3 write or lookup."""

    tokens: tuple[int, ...]
    kv: mx.array
    parent: bytes | None = None
    state: mx.array | None = None  # a hybrid model's partial page: the state after its tokens (uint8)
    in_l3: bool = False


class DeviceTier(Tier[DevicePage]):
    """L1, whose pages can also be found from the page before them: a prompt that shares
    only the start of a page (a full one, or a request's last partial page) reuses that
    start. A partial page counts as a whole page against the cap."""

    def __init__(self, capacity: int, page_nbytes: int, policy: EvictionPolicy | None = None) -> None:
        super().__init__("L1", capacity, page_nbytes, policy)
        self._after: dict[bytes, set[PageKey]] = {}

    def add(self, key: PageKey, entry: DevicePage, cost: float = 1.0) -> None:
        super().add(key, entry, cost)
        if entry.parent is not None:
            self._after.setdefault(entry.parent, set()).add(key)

    def pop(self, key: PageKey) -> DevicePage:
        entry = super().pop(key)
        if entry.parent is not None:
            following = self._after[entry.parent]
            following.discard(key)
            if not following:
                del self._after[entry.parent]
        return entry

    def following(self, parent: bytes) -> list[tuple[PageKey, DevicePage]]:
        """The pages whose previous page is ``parent`` (not marked used)."""
        return [(key, self.entries[key]) for key in self._after.get(parent, ())]

    def view(self) -> TierView:
        """With the size of the follower index: it holds no emptied set, so it never
        outgrows the pages in L1."""
        return replace(
            super().view(), follower_parents=len(self._after), follower_pages=sum(map(len, self._after.values()))
        )


@dataclass(frozen=True)
class HostPage:
    """An L2 page: its token ids and the arena slot holding its bytes (``in_l3``: as
    ``DevicePage``'s)."""

    tokens: tuple[int, ...]
    slot: int
    in_l3: bool = False


class HostTier(Tier[HostPage]):
    """L2: one preallocated arena of page slots, so spilling never allocates.

    With a ``codec`` (``tiers.quant.PageCodec``) a slot holds a page quantized, and a
    page counts its quantized bytes against the cap (unless ``page_nbytes`` says
    otherwise), so the same bytes hold more pages: ``write`` and ``fill`` quantize,
    ``read`` dequantizes (lossy: DESIGN §4a). Without, a slot holds the page's bytes."""

    def __init__(
        self,
        capacity: int,
        slot_nbytes: int,
        page_nbytes: int | None = None,
        policy: EvictionPolicy | None = None,
        codec: PageCodec | None = None,
    ) -> None:
        slot_nbytes = codec.stored_nbytes if codec is not None else slot_nbytes
        super().__init__("L2", capacity, page_nbytes or slot_nbytes, policy)
        self.codec = codec
        self.arena = slot_arena(self.max_pages, slot_nbytes)
        self.free_slots = list(range(self.max_pages - 1, -1, -1))

    def write(
        self, key: PageKey, tokens: tuple[int, ...], data: np.ndarray | bytes, cost: float = 1.0, in_l3: bool = False
    ) -> None:
        """Copy one page's bytes into a free slot (quantized with the tier's codec)."""
        slot = self.take_slot()
        self.fill(key, tokens, slot, cost, in_l3, data)

    def has_room(self) -> bool:
        """A slot is free (slots reserved by ``take_slot`` and not yet filled are not)."""
        return bool(self.free_slots)

    def take_slot(self) -> int:
        """Reserve a free slot to be filled in place (then ``fill``, or ``give_back``)."""
        if not self.has_room():
            raise MemoryError("L2 is full")
        return self.free_slots.pop()

    def fill(
        self,
        key: PageKey,
        tokens: tuple[int, ...],
        slot: int,
        cost: float = 1.0,
        in_l3: bool = False,
        raw: np.ndarray | bytes | None = None,
        stored: memoryview | bytes | np.ndarray | None = None,
    ) -> None:
        """Index a reserved slot: its bytes in place (``raw_slot``), or the page's ``raw``
        bytes, copied in (quantized with the tier's codec), or ``stored``, the page
        already in the tier's codec (a checked L3 payload of that codec), copied in as it
        is: quantizing its decoded bytes again would not give them back (lossy)."""
        if stored is None and raw is not None:
            stored = raw if self.codec is None else self.codec.encode(self.codec.name, raw)
        if stored is not None:
            self.arena[slot] = np.frombuffer(stored, dtype=np.uint8)
        self.add(key, HostPage(tokens, slot, in_l3), cost)

    def raw_slot(self, slot: int) -> np.ndarray | None:
        """Where a page's raw bytes can be written in place into a reserved slot; None
        when the tier quantizes (``fill`` them instead)."""
        return self.arena[slot] if self.codec is None else None

    def give_back(self, slot: int) -> None:
        self.free_slots.append(slot)

    def view(self) -> TierView:
        return replace(super().view(), free_slots=len(self.free_slots))

    def read(self, key: PageKey) -> np.ndarray:
        """The page's bytes, a view into the arena (valid until the page leaves L2); when
        the tier quantizes, dequantized into new memory."""
        stored = self.arena[self.entries[key].slot]
        return stored if self.codec is None else self.codec.decode(stored)

    def pop(self, key: PageKey) -> HostPage:
        entry = super().pop(key)
        self.give_back(entry.slot)
        return entry


def kv_to_host(kv: mx.array) -> np.ndarray:
    """A page's device array as raw bytes (uint8, C order)."""
    if kv.dtype == mx.bfloat16:
        kv = kv.view(mx.uint16)
    return np.asarray(kv).reshape(-1).view(np.uint8)
