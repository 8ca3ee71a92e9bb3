"""How much of its filesystem an LMDB store may take: the default cap of a new store,
and the room the disk leaves for the records of the next commit.

A cap the disk cannot hold is never reached: the file grows until the filesystem is
full, every later commit fails (LMDB reports ENOSPC as "Input/output error") and
nothing is evicted, because the records stay under the cap. So a new store's default
cap is the smaller of ``DEFAULT_CAPACITY`` and half the free space, and a store whose
file has no ``room`` left to grow holds its pages where they are and evicts for every
write (``DiskTier``), whatever its cap.

``usage`` is the one place the filesystem is asked (tests stand a small one in for it).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

from ..text import format_bytes

DEFAULT_CAPACITY = 32 << 30  # the cap of a new store when none is asked for, on a large disk
_RESERVE_MAX = 1 << 30  # left free for everything else on the disk: 1/20 of it, at most this


class Usage(NamedTuple):
    total: int
    used: int
    free: int


def usage(path: Path) -> Usage:
    """The filesystem that holds ``path``: total, used and free bytes."""
    return Usage(*shutil.disk_usage(path))


def default_capacity(path: Path) -> tuple[int, str]:
    """The cap of a new store at ``path`` and why: the smaller of the default and half
    the free space of its filesystem."""
    free = usage(path).free
    if free // 2 < DEFAULT_CAPACITY:
        return free // 2, f"half the free space of its filesystem ({format_bytes(free)} free)"
    return DEFAULT_CAPACITY, f"the default; its filesystem has {format_bytes(free)} free"


def room(path: Path) -> int:
    """Bytes the store's file at ``path`` may still grow by: the filesystem's free space
    less a reserve for everything else on it (negative: it ate into the reserve)."""
    disk = usage(path)
    return disk.free - min(disk.total // 20, _RESERVE_MAX)
