"""The L3 backend a store string names, and throwaway stores beside one.

Above every backend (``lmdb_store``, ``redis_store``) and below the hierarchy: the
backends import ``base``, never this module, so there is no cycle. Redis is imported only
when a URL asks for it: LMDB users never load the redis client.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .base import L3Store, StoreError

__all__ = ["URL_SCHEMES", "StoreError", "is_url", "open_l3", "scratch_location"]

URL_SCHEMES = ("redis://", "rediss://", "redis+cluster://")


def is_url(store: str | Path | None) -> bool:
    """Whether a ``--store`` names a server (Redis / Valkey) rather than a directory."""
    return isinstance(store, str) and store.startswith(URL_SCHEMES)


def open_l3(store: str | Path, capacity_bytes: int | None = None, **options) -> L3Store:
    """The L3 backend a store string names: a ``redis://``, ``rediss://`` or
    ``redis+cluster://`` URL, else an LMDB directory. StoreError when it cannot be used."""
    if is_url(store):
        from .redis_store import RedisTier  # imported on use: LMDB users never load redis

        return RedisTier(str(store), capacity_bytes, **options)
    from .lmdb_store import DiskTier

    return DiskTier(Path(store), capacity_bytes, **options)


@contextmanager
def scratch_location(store: str | Path) -> Iterator[str | Path]:
    """A throwaway store beside ``store`` (same disk, same server) for measurements,
    removed afterwards: a directory inside it, or the same server under its own prefix."""
    if is_url(store):
        from .redis_store import scratch_url

        with scratch_url(str(store)) as url:
            yield url
        return
    Path(store).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store, prefix="calibration-") as scratch:
        yield Path(scratch)
