"""Opening a store's L3, now or later: a server that did not answer at start (a Redis
down, or not up yet) is retried in the background, with a back-off that doubles to a
cap, until it answers, and then joins the running store (no restart), or until the
store closes. Any other failure (a damaged env, another format version, a bad URL) is
final: the store runs without L3 and says so once.

Why in the background: a store that opened without L3 serves from L1 and L2 meanwhile;
nothing on a request's path waits for the server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .l3.base import L3Store, StoreError, StoreUnreachable
from .page import Namespace, PageGeometry

log = logging.getLogger(__name__)

_FIRST_RETRY_S = 0.1
_MAX_RETRY_S = 5.0


def open_disk(opener: Callable[[], L3Store]) -> tuple[L3Store | None, bool]:
    """L3 (``opener()``) if it can be used now, else None (warned once); and whether to
    retry it (its server did not answer)."""
    try:
        return opener(), False
    except StoreUnreachable as err:
        log.warning("running without L3 until it answers (retried in the background): %s", err)
        return None, True
    except StoreError as err:
        log.warning("running without L3: %s", err)
        return None, False


def join_later(
    opener: Callable[[], L3Store], closing: threading.Event, join: Callable[[L3Store], bool]
) -> threading.Thread:
    """Retry ``opener`` on a thread until L3 opens (``join(disk)``; False: the store closed
    meanwhile, the disk is closed again), a final error, or ``closing``."""

    def run() -> None:
        delay = _FIRST_RETRY_S
        while not closing.wait(delay):
            try:
                disk = opener()
            except StoreUnreachable:
                delay = min(2 * delay, _MAX_RETRY_S)
                continue
            except StoreError as err:
                log.warning("running without L3: %s", err)
                return
            if join(disk):
                log.warning("L3 store %s answers: using it from now on", disk.location)
            else:
                disk.close()
            return

    thread = threading.Thread(target=run, name="kvtier-l3-join", daemon=True)
    thread.start()
    return thread


def describe(disk: L3Store, namespace: Namespace, geometry: PageGeometry, label: str, snapshots: bytes | None) -> None:
    """Name a store's namespaces in ``disk``'s table (``kvtier store ls``): its pages'
    (with their lossy codecs, if any), and its state snapshots' (``snapshots``: their
    namespace digest) if it keeps any."""
    model, salted = label or namespace.model_fingerprint[:12], bool(namespace.cache_salt)
    pages = f"{model} ({namespace.codecs})" if namespace.codecs else model
    disk.tables.describe_namespace(
        namespace.digest(),
        {"model": pages, "page_size": geometry.page_size, "dtype": geometry.dtype, "salted": salted},
    )
    if snapshots is not None:
        disk.tables.describe_namespace(
            snapshots, {"model": f"{model} (state snapshots)", "page_size": 0, "dtype": "uint8", "salted": salted}
        )
