"""The dashboard's actions and its operator view, all under one prefix, ``ADMIN_PREFIX``
(``/v1/kvtier/admin/...``), so that one check can guard them all: clear an L3
namespace, change L3's cap, pin or unpin a recent request's prompt in the fast tiers,
and read a recent request's prompt as text, token by token.

Every bad input is a 4xx with an OpenAI-style error object. A pin is a store pin
(``TieredStore.keeping.pin``) of the request's leading full pages that L1 or L2 holds, kept
until it is unpinned or the server stops; operator pins share the limit of the
server's other holds (``holds``), so pins can never fill the fast tiers.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from kvtier.tiers.hierarchy import TieredStore
from kvtier.tiers.page import PageKey

from ..engine import Engine
from .api import APIError, invalid
from .recent import RecentRequests, RequestRecord

ADMIN_PREFIX = "/v1/kvtier/admin"
MAX_BODY = 4096  # an action's body is a few fields


class Pins:
    """The operator's pins, by request id."""

    def __init__(self, store: TieredStore | None, limit: int) -> None:
        self.store, self.limit = store, limit
        self._pins: dict[int, list[PageKey]] = {}
        self._lock = threading.Lock()

    def pin(self, record: RequestRecord) -> int:
        """Pin ``record``'s leading pages held in L1 or L2; pinning it again renews nothing."""
        if self.store is None:
            raise APIError(409, "this server has no store: nothing to pin", code="no_store")
        with self._lock:
            if record.rid in self._pins:
                return len(self._pins[record.rid])
            n = self.store.keeping.pin(list(record.keys), self.limit)
            if n:
                self._pins[record.rid] = list(record.keys[:n])
            return n

    def unpin(self, rid: int) -> int:
        with self._lock:
            keys = self._pins.pop(rid, None)
        if keys is None:
            raise APIError(404, f"request {rid} is not pinned", "not_found_error", param="rid", code="not_pinned")
        assert self.store is not None  # only a store's pages are ever pinned
        self.store.release(keys)
        return len(keys)

    def listing(self) -> list[dict]:
        with self._lock:
            return [{"rid": rid, "pages": len(keys)} for rid, keys in self._pins.items()]


class Admin:
    def __init__(self, engine: Engine, recent: RecentRequests, pins: Pins, tokenizer: Any) -> None:
        self.engine, self.recent, self.pins, self.tokenizer = engine, recent, pins, tokenizer

    def mount(self) -> Mount:
        """Every admin route, under ``ADMIN_PREFIX``."""
        return Mount(
            ADMIN_PREFIX,
            routes=[
                Route("/clear", self.clear, methods=["POST"]),
                Route("/resize", self.resize, methods=["POST"]),
                Route("/pin", self.pin, methods=["POST"]),
                Route("/unpin", self.unpin, methods=["POST"]),
                Route("/requests/{rid:int}/tokens", self.tokens, methods=["GET"]),
            ],
        )

    async def clear(self, http: HTTPRequest) -> Response:
        """Delete the L3 pages of one namespace, named by a unique prefix of its hex digest."""
        prefix = (await _body(http, Clear)).namespace.lower()
        disk = self._disk()
        matches = [d for d in disk.tables.namespaces() if d.hex().startswith(prefix)]
        if len(matches) != 1:
            raise invalid(f"namespace {prefix!r} matches {len(matches)} namespaces of the store", "namespace")
        pages, nbytes = await anyio.to_thread.run_sync(disk.clear, set(matches))
        return JSONResponse({"namespace": matches[0].hex(), "pages": pages, "bytes": nbytes})

    async def resize(self, http: HTTPRequest) -> Response:
        """Set L3's cap (bytes, more than 0), evicting least-recently-used pages down to it."""
        size = (await _body(http, Resize)).l3_bytes
        disk = self._disk()
        if disk.backend != "lmdb":
            raise invalid("a Redis store evicts by its own maxmemory: resize it there", "l3_bytes")
        old = disk.counters.capacity
        evicted = await anyio.to_thread.run_sync(disk.resize, size)
        return JSONResponse({"old_bytes": old, "l3_bytes": size, "evicted_pages": evicted})

    async def pin(self, http: HTTPRequest) -> Response:
        record = self._record((await _body(http, RequestId)).rid)
        pinned = await anyio.to_thread.run_sync(self.pins.pin, record)
        return JSONResponse({"rid": record.rid, "pages": pinned})

    async def unpin(self, http: HTTPRequest) -> Response:
        rid = (await _body(http, RequestId)).rid
        return JSONResponse({"rid": rid, "pages": await anyio.to_thread.run_sync(self.pins.unpin, rid)})

    async def tokens(self, http: HTTPRequest) -> Response:
        """A recent request's prompt, one entry per token: its text and where its KV came from."""
        record = self._record(http.path_params["rid"])
        texts = await anyio.to_thread.run_sync(lambda: [self.tokenizer.decode([t]) for t in record.prompt])
        sources = [source for source, n in record.strip for _ in range(n)]
        return JSONResponse({"rid": record.rid, "tokens": [{"text": t, "source": s} for t, s in zip(texts, sources)]})

    def _record(self, rid: int) -> RequestRecord:
        record = self.recent.find(rid)
        if record is None:
            raise APIError(
                404, f"request {rid} is not among the recent requests", "not_found_error", param="rid", code="not_found"
            )
        return record

    def _disk(self):
        store = self.engine.store
        if store is None or store.disk is None:
            raise APIError(409, "this server has no L3 store", code="no_store")
        return store.disk


class _Action(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Clear(_Action):
    namespace: str = Field(min_length=1)  # a unique prefix of its hex digest


class Resize(_Action):
    l3_bytes: int = Field(gt=0)


class RequestId(_Action):
    rid: int


_A = TypeVar("_A", bound=_Action)


async def _body(http: HTTPRequest, action: type[_A]) -> _A:
    """The checked body, or a 400 (413 past ``MAX_BODY``) that names its first fault in one line."""
    raw = await http.body()
    if len(raw) > MAX_BODY:
        raise APIError(413, f"body is over the limit of {MAX_BODY} bytes", code="body_too_large")
    try:
        return action.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        raise invalid(f"{param or 'body'}: {first['msg']}", param) from None
