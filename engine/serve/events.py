"""``GET /v1/kvtier/events``: what this backend holds and how busy it is, as server-sent
events (DESIGN §11), for a fleet router that sends each request where its pages are.

Every event's data is one JSON object with ``seq`` (0 for the first event of a
connection, +1 for each after it) and ``epoch`` (random, one per server start):

- ``hello``, always first: the namespace, page size and bytes, the cost profile, the
  whole pages L1 and L2 hold (hex page keys) and the load: the snapshot the changes
  after it apply to.
- ``pages``: one tier's changes since the last such event (at most one per tier every
  ``PAGES_EVERY_S``), as the net effect on that tier: ``stored`` pages it holds now and
  did not, ``evicted`` pages it held and does not (disjoint; a page moving L1 -> L2 is
  evicted from L1 and stored in L2).
- ``load``: requests running and waiting and the prompt tokens not yet prefilled, when
  they change (at most every ``LOAD_EVERY_S``) and at least every ``HEARTBEAT_S``.
- ``profile``: the cost profile, when online refinement changed it (checked every
  ``PROFILE_EVERY_S``).

A client resynchronises by reconnecting: a new connection starts with a fresh hello.
The changes of a connection wait in its own bounded list (``queue_changes``), noted
under the store's lock and sent from the event loop, so a slow or stalled reader never
holds up the engine; past the bound that list is dropped and the stream ends, and the
client, seeing the connection close, reconnects for a new snapshot. Streams also end
when the server begins to stop (``close``), so they never hold up its shutdown.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import anyio
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvtier.tiers.residency import Change, Holdings

from ..engine import Engine

EVENTS_PATH = "/v1/kvtier/events"
PAGES_EVERY_S = 0.05
LOAD_EVERY_S = 0.1
HEARTBEAT_S = 2.0
PROFILE_EVERY_S = 5.0
QUEUE_CHANGES = 65536  # page changes a connection may have unsent before it is closed


@dataclass(frozen=True)
class Load:
    """How busy the engine is: requests in the batch, requests not admitted yet (held ones
    included), and prompt tokens admitted or waiting but not yet prefilled (a waiting
    request's whole prompt: what it will find cached is known only at admission)."""

    running: int
    waiting: int
    pending_tokens: int


def engine_load(engine: Engine) -> Load:
    """The engine's load now, from what its scheduler and batch already know."""
    view = engine.view()
    running = view.running.values()
    unprefilled = sum(max(len(r.prompt) - r.prefix_tokens - r.prefilled, 0) for r in running)
    queued = sum(len(r.prompt) for r in engine.scheduler.queued())
    return Load(len(view.running), view.pending, unprefilled + queued)


class Changes:
    """One connection's unsent page changes, at most ``limit``: a watcher of the store's
    residency (``tiers.residency``), called under the store's lock, so it only appends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.overflowed = False  # past the limit: the list was dropped, the stream must end
        self._changes: list[Change] = []
        self._lock = threading.Lock()

    def __call__(self, change: Change) -> None:
        with self._lock:
            if self.overflowed:
                return
            if len(self._changes) >= self.limit:
                self.overflowed = True
                self._changes = []
                return
            self._changes.append(change)

    def take(self) -> list[Change]:
        with self._lock:
            taken, self._changes = self._changes, []
            return taken


def net_changes(changes: Iterable[Change]) -> dict[str, tuple[list[str], list[str]]]:
    """Per tier, (stored, evicted) hex keys: the net effect of ``changes`` in order. A page
    whose last change leaves it as it was before the first (stored then evicted, or the
    reverse) is in neither."""
    first: dict[tuple[str, bytes], bool] = {}
    last: dict[tuple[str, bytes], bool] = {}
    for change in changes:
        where = (change.tier, change.key)
        first.setdefault(where, change.stored)
        last[where] = change.stored
    out: dict[str, tuple[list[str], list[str]]] = {}
    for (tier, key), stored in last.items():
        # a first "stored" means it was absent before; a first "evicted" that it was there
        if first[(tier, key)] == stored:
            stored_keys, evicted_keys = out.setdefault(tier, ([], []))
            (stored_keys if stored else evicted_keys).append(key.hex())
    return out


class EventStream:
    """The events route of one server: its epoch and the open streams' end."""

    def __init__(self, engine: Engine, queue_changes: int = QUEUE_CHANGES) -> None:
        self.engine = engine
        self.queue_changes = queue_changes
        self.epoch = secrets.token_hex(8)
        self._closing = threading.Event()

    def route(self) -> Route:
        return Route(EVENTS_PATH, self.events, methods=["GET"])

    def close(self) -> None:
        """End every stream at its next tick, and refuse none: a stream opened later ends
        at once after its hello (the server is stopping)."""
        self._closing.set()

    async def events(self, http: HTTPRequest) -> Response:
        return StreamingResponse(self._stream(http), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def hello(self, holdings: Holdings, load: Load) -> dict:
        engine = self.engine
        return {
            "namespace": dataclasses.asdict(engine.namespace),
            "page_size": engine.config.page_size,
            "page_bytes": engine.geometry.nbytes,
            "profile": engine.profile.to_dict(),
            "pages": {"L1": [k.hex() for k in holdings.l1], "L2": [k.hex() for k in holdings.l2]},
            "load": dataclasses.asdict(load),
        }

    async def _stream(self, http: HTTPRequest) -> AsyncIterator[str]:
        store, seq = self.engine.store, itertools.count()
        changes = Changes(self.queue_changes)
        holdings = store.residency.watch(changes) if store is not None else Holdings((), ())
        try:
            load = await anyio.to_thread.run_sync(engine_load, self.engine)
            profile = self.engine.profile.to_dict()
            yield self._event("hello", next(seq), self.hello(holdings, load))
            last_load = last_check = last_profile = time.monotonic()
            while not self._closing.is_set():
                await anyio.sleep(PAGES_EVERY_S)
                if changes.overflowed or await http.is_disconnected():
                    return  # an overflowed client reconnects for a fresh snapshot; a gone one is gone
                for tier, (stored, evicted) in sorted(net_changes(changes.take()).items()):
                    yield self._event("pages", next(seq), {"tier": tier, "stored": stored, "evicted": evicted})
                now = time.monotonic()
                if now - last_check >= LOAD_EVERY_S:
                    last_check, current = now, await anyio.to_thread.run_sync(engine_load, self.engine)
                    if current != load or now - last_load >= HEARTBEAT_S:
                        load, last_load = current, now
                        yield self._event("load", next(seq), dataclasses.asdict(load))
                if now - last_profile >= PROFILE_EVERY_S:
                    last_profile, refined = now, self.engine.profile.to_dict()
                    if refined != profile:
                        profile = refined
                        yield self._event("profile", next(seq), {"profile": profile})
        finally:
            if store is not None:
                store.residency.unwatch(changes)

    def _event(self, name: str, seq: int, data: dict) -> str:
        body = json.dumps({"seq": seq, "epoch": self.epoch, **data}, separators=(",", ":"))
        return f"event: {name}\ndata: {body}\n\n"
