"""The client of one backend's event stream (``GET /v1/kvtier/events``, server-sent
events): it applies each event to the :class:`Backend`, and on a gap, a bad event, an
error status, silence past ``READ_TIMEOUT_S`` (the backend sends a load event at least
every 2 s) or a dropped connection it drops the backend's index and reconnects, with a
back-off that doubles up to ``MAX_BACKOFF_S``; the next hello rebuilds the index. A
router that restarts rebuilds every index the same way: nothing is kept but the streams.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import anyio
import httpx

from .backend import Backend, Resync

log = logging.getLogger(__name__)

EVENTS_PATH = "/v1/kvtier/events"
READ_TIMEOUT_S = 5.0  # more than two heartbeats
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.2, 2.0


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, dict]]:
    """(event name, its JSON data) of each server-sent event; comments and events without
    data are skipped, data that is not a JSON object is a Resync."""
    event, data = "message", list[str]()
    async for line in lines:
        if line == "":
            if data:
                try:
                    parsed = json.loads("\n".join(data))
                except ValueError:
                    parsed = None
                if not isinstance(parsed, dict):
                    raise Resync(f"event {event}: data is not a JSON object")
                yield event, parsed
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


async def follow(client: httpx.AsyncClient, backend: Backend, headers: dict[str, str]) -> None:
    """Follow ``backend``'s stream for ever (until cancelled), reconnecting after each end."""
    backoff = FIRST_BACKOFF_S
    while True:
        try:
            timeout = httpx.Timeout(READ_TIMEOUT_S, connect=READ_TIMEOUT_S)
            async with client.stream("GET", backend.url + EVENTS_PATH, headers=headers, timeout=timeout) as response:
                if response.status_code != 200:
                    raise Resync(f"{backend.name}{EVENTS_PATH} answered {response.status_code}")
                async for event, data in sse_events(response.aiter_lines()):
                    backend.apply(event, data)
                    backoff = FIRST_BACKOFF_S  # a stream that got this far is worth reconnecting at once
            why = "the stream ended"
        except Resync as err:
            why = str(err)
        except (httpx.HTTPError, OSError) as err:
            why = f"{type(err).__name__}"
        if backend.synced:
            log.info("%s: %s; its index is dropped until the next hello", backend.name, why)
        else:
            log.debug("%s: %s", backend.name, why)
        backend.lost()
        await anyio.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF_S)
