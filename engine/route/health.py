"""Health checks: ``GET /health`` on each backend every ``INTERVAL_S``. A backend that
refuses the connection is taken out at once; one that answers late or with an error
after ``FAILURES`` checks in a row (one slow answer on a busy machine is not a death).
A backend taken out is sent nothing and its index is dropped; when it answers again
it is back in, and its event stream's next hello rebuilds what it holds.
"""

from __future__ import annotations

import logging

import anyio
import httpx

from .backend import Backend

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
TIMEOUT_S = 2.0
FAILURES = 2


def mark(backend: Backend, ok: bool, refused: bool = False) -> None:
    """One check's outcome (a failed proxy attempt is one too, a refused one)."""
    if ok:
        if not backend.healthy:
            log.info("%s is up", backend.name)
        backend.healthy, backend.failures = True, 0
        return
    backend.failures += 1
    if backend.healthy and (refused or backend.failures >= FAILURES):
        log.warning("%s does not answer: taken out", backend.name)
        backend.healthy = False
        backend.lost()


async def check(client: httpx.AsyncClient, backend: Backend) -> None:
    try:
        response = await client.get(backend.url + "/health", timeout=TIMEOUT_S)
        mark(backend, response.status_code == 200)
    except httpx.ConnectError:
        mark(backend, False, refused=True)
    except (httpx.HTTPError, OSError):
        mark(backend, False)


async def watch(client: httpx.AsyncClient, backend: Backend) -> None:
    """Check ``backend`` for ever (until cancelled)."""
    while True:
        await check(client, backend)
        await anyio.sleep(INTERVAL_S)
