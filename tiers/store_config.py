"""What a store is made with (``StoreConfig``) and what it shows of itself
(``StoreView``); both re-exported by ``tiers.hierarchy``, where callers find them."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .join import JoinLimits
from .l3.base import L3Store
from .l3.cipher import RecordCipher
from .l3.open import open_l3
from .page import PageKey
from .policy import DEFAULT_POLICY, l3_order
from .tier import TierView


@dataclass(frozen=True)
class StoreView:
    """The store's state at one moment, read-only: its in-process tiers and its pins."""

    l1: TierView
    l2: TierView
    pins: Mapping[PageKey, int]  # pinned page -> pins held (a request's restore, each)
    l3_open: bool  # an L3 backend is open (False once ``close`` has flushed and closed it)
    snapshots: tuple[TierView, TierView] | None = None  # a hybrid model's snapshot L1 and L2


@dataclass
class StoreConfig:
    l1_bytes: int = 1 << 30
    l2_bytes: int = 4 << 30
    l3_bytes: int | None = None  # None: the store's own cap (a new store: 32 GiB)
    store_dir: Path | str | None = None  # an LMDB directory, or a redis:// URL (tiers.l3.open.open_l3)
    codec: str = "raw"  # L3's page codec (tiers.l3.record.CODECS)
    # Tier ("L2" or "L3") -> bytes per second: reads from that tier take at least
    # bytes / rate (the rest is slept), and the link counters show it (tests, demos).
    # "L3" slows the reads of L3 pages (L3->L1, L3->L2); "L2" slows the L2->L1 join of
    # every page that crosses it (so also of compressed L3 pages decoded into L2).
    throttle: dict[str, float] = field(default_factory=dict)
    policy: str = DEFAULT_POLICY  # eviction order of every tier (tiers.policy)
    l3_admit: str = "always"  # or "second-use": write a page to L3 once it is seen twice
    # What one page counts against every cap (None: its payload size). A trace replay
    # stores payloads of a few bytes and counts them as full-size pages.
    page_bytes: int | None = None
    l3_queue_pages: int = 64  # L3 writes queued before more are dropped
    label: str = ""  # what `kvtier store ls` calls these pages' model (its name)
    # a hybrid model's recurrent-state snapshots (tiers.snapshots): their own L1 and L2 caps
    snapshot_l1_bytes: int = 256 << 20
    snapshot_l2_bytes: int = 1 << 30
    # L3 records encrypted with this (``tiers.l3.cipher``); the namespace must say so
    cipher: RecordCipher | None = None
    # An L3 already open, shared by several stores of one process (a fleet replay's engines:
    # LMDB must not be opened twice in a process); used instead of ``store_dir``, and
    # closed by whoever opened it, never by a store using it
    shared_l3: L3Store | None = None
    # L2's codec: raw, or a quantizing one (tiers.quant); a lossy codec of either tier is
    # in the namespace. After the older fields, so that they keep their positions.
    l2_codec: str = "raw"
    # How a restore's copies are cut up over threads and arrays (``tiers.join.JoinLimits``).
    # Last, like l2_codec: positional configs keep their meaning.
    join_limits: JoinLimits = field(default_factory=JoinLimits)
    # L3 writes of spilled pages at most this many bytes per second, admitted by their expected
    # saving (``tiers.write_budget``); None: unbudgeted
    l3_write_budget: float | None = None
    # The store's clock (seconds), which the write budget fills on: wall time, or a replay's trace time
    clock: Callable[[], float] = time.monotonic
    # Write-through (``Placement.write_through``): every full page (and snapshot) publish keeps
    # is queued for L3 at once, not when it spills; for a fleet whose engines share the L3.
    # Last: positional configs keep their meaning.
    l3_write_through: bool = False

    def __post_init__(self) -> None:
        if self.l3_write_through and self.l3_write_budget is not None:
            raise ValueError("an L3 written through takes no write budget: the budget ranks pages as they spill")


def open_l3_of(config: StoreConfig) -> L3Store:
    """The L3 that ``config.store_dir`` names, opened as a store made with ``config`` opens
    it (StoreError when it cannot be used)."""
    assert config.store_dir is not None, "a store config without L3"
    return open_l3(
        config.store_dir,
        config.l3_bytes,
        codec=config.codec,
        queue_pages=config.l3_queue_pages,
        record_bytes=config.page_bytes,
        policy=l3_order(config.policy),
        cipher=config.cipher,
    )
