"""The lock that keeps compaction apart from every other opener of an LMDB store.

LMDB's own lock file cannot serve: its locks are POSIX record locks, held per process
and file, so the environment compaction opens to copy the store takes (and on close
drops) the very lock compaction holds, and another process could open the old file
during the copy and write pages that the new file never gets. ``STORE/lock`` is locked
with ``flock`` instead, which is per open file and independent of LMDB's record locks:
every ``DiskTier`` holds it shared for as long as it has the store open; compaction
holds it exclusively from before it reads the store until the new file is in place.

Policy: compaction never waits (it refuses in one line while anyone has the store
open); an opener that finds compaction running waits for it to finish, up to
``WAIT_S`` (one warning when it starts waiting), then gives up with StoreError.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .base import StoreError

log = logging.getLogger(__name__)

LOCK_NAME = "lock"
PARTIAL_PREFIX = "compact-"  # compaction copies into STORE/compact-XXXX before the swap
WAIT_S = 600.0  # an opener waits this long for a compaction to finish
_POLL_S = 0.05


class StoreLock:
    """One hold of ``STORE/lock`` (shared or exclusive) until ``release``."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def shared(cls, path: Path, wait_s: float = WAIT_S) -> StoreLock | None:
        """Hold the store shared (waiting for a compaction to end); None where the lock
        file is absent and cannot be created (a read-only directory, which no process
        of this user compacts either)."""
        fd = _open(path)
        if fd is None:
            return None
        deadline = time.monotonic() + wait_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return cls(fd)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise StoreError(
                        f"store {path} is being compacted by another process (waited {wait_s:.0f} s)"
                    ) from None
                if not waited:
                    log.warning("store %s is being compacted by another process; waiting for it", path)
                    waited = True
                time.sleep(_POLL_S)

    @classmethod
    def exclusive(cls, path: Path) -> StoreLock:
        """Hold the store alone, without waiting; StoreError when anyone has it open."""
        fd = _open(path)
        if fd is None:
            raise StoreError(f"cannot lock store {path}: its directory is not writable")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(f"store {path} is open in another process; stop it before compacting") from None
        return cls(fd)

    def release(self) -> None:
        """Let go (idempotent): closing the file drops the lock."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _open(path: Path) -> int | None:
    try:
        return os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        pass
    except OSError as exc:
        raise StoreError(f"cannot lock store {path}: {exc.strerror or exc}") from None
    try:  # a read-only directory or lock file: a shared flock needs no write access
        return os.open(path / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return None


def remove_partial_copies(path: Path) -> None:
    """Delete what a killed compaction left (``compact-*`` directories). Only while the
    store is held shared: then no compaction is running."""
    for partial in path.glob(PARTIAL_PREFIX + "*"):
        if partial.is_dir():
            shutil.rmtree(partial, ignore_errors=True)
            if not partial.exists():
                log.info("removed %s, left by an interrupted compaction", partial)


class EnvUsers:
    """The caller threads inside one process's environment (snapshots hand out views into
    its map), so that replacing the environment (``DiskTier`` reopening a store another
    process replaced) closes the old one only once no thread can still read it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0

    @contextmanager
    def using(self) -> Iterator[None]:
        """A thread reads the environment for the length of the block."""
        with self._cond:
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self, timeout_s: float) -> Iterator[bool]:
        """No thread is inside (True) for the length of the block, and none enters;
        False when threads stayed inside for ``timeout_s`` (they may wait on this one)."""
        with self._cond:
            yield self._cond.wait_for(lambda: self._inside == 0, timeout_s)
