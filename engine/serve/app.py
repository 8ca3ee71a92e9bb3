"""``kvtier serve``: OpenAI- and Anthropic-compatible HTTP on one :class:`Engine` (DESIGN §8a).

The engine keeps mlx on its one serving thread (``Engine.start``); handlers only
tokenize, submit, read ``Request.stream`` and cancel. Blocking calls (submission
takes the store's lock, a stream waits for the next token) run in worker threads,
so the event loop never waits on the engine.

A request's life here: its API key checked (``tenancy.Authenticate``: 401, or 403 for
the server's own numbers without an admin key), read the body (413 past the limit),
check it (``api``: 400 or 404), render and tokenize the prompt, find where its keys
start (its tenant's root, ``tenancy``), check it against the context, refuse it
with 429 if the waiting queue is full, submit, then stream or collect the text, cut at
the first stop string. A client that goes away cancels its request (batch slot and
pins released). On shutdown (``draining.DrainingServer``) the server stops accepting, lets
the requests in flight run for the drain timeout, then cancels those left, whose
streams end with an error event; then the engine closes, which flushes L1 and L2 to L3.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvtier.tiers.page import ChainRoot

from ..engine import Engine
from ..limits import InputError, TextLimit, context_length
from ..request import Request, SamplingParams
from ..text import OutputText
from ..text import verbatim as verbatim_text
from . import api, responses
from .admin import Admin, Pins
from .api import APIError
from .conversations import Conversations, log_loss, miss_reason
from .dashboard import Dashboard
from .events import QUEUE_CHANGES, EventStream
from .generation import Generation, cancel_on_disconnect
from .holds import TOOL_WAIT, Holds
from .prometheus import ServerMetrics
from .prompt import Prompt, anthropic_prompt, chat_prompt, check_text
from .recent import RecentRequests
from .responses import Finished
from .tenancy import Authenticate, Tenancy
from .tools import ToolCallText

log = logging.getLogger(__name__)

ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# The id of a server started without --model or --served-model-name: the same whichever
# default model is installed (SmolLM2-135M-Instruct or kvtier-tiny), so the README's
# examples and a client's settings work on either.
DEFAULT_MODEL_ID = "kvtier-default"
RETRY_AFTER_S = 1  # a 429's Retry-After: a batch slot frees as soon as one request ends


@dataclass
class ServerConfig:
    model_name: str  # the id clients send as ``model`` and ``/v1/models`` lists
    max_waiting: int = 64  # requests queued for a batch slot; past it, 429
    default_max_tokens: int = 512  # when a request names none (capped by the context)
    max_body_bytes: int = 8 << 20  # larger bodies answer 413
    body_timeout_s: float = 60.0  # a body not all received by then answers 408 (a trickling client)
    tool_warm_s: float = 120.0  # an answer that ends in a tool call is held this long (0: not held)
    events_queue: int = QUEUE_CHANGES  # page changes an events stream may have unsent before it is closed


class KVTierServer:
    """The ASGI app and what it shares: the engine, its metrics, the requests in flight."""

    def __init__(self, engine: Engine, config: ServerConfig, tenancy: Tenancy | None = None) -> None:
        self.engine = engine
        self.config = config
        # without one: no keys, and a secret of this process's for cache_salt roots
        self.tenancy = tenancy or Tenancy({}, os.urandom(32), engine.root, engine.config.page_size)
        self.tokenizer = engine.loaded.tokenizer
        self.context = context_length(engine.loaded) or 32768
        self.text_limit = TextLimit.measure(self.tokenizer, self.context)  # refuses huge prompts untokenized
        self.created = int(time.time())
        self._live: dict[int, Request] = {}  # by rid
        self._closing = threading.Event()  # ends the holds' sweeper
        self.conversations = Conversations(engine.config.page_size)
        store = engine.store
        self.holds = Holds(store, store.accounts.view().l1.max_pages // 2 if store is not None else 0)
        self.metrics = ServerMetrics(engine.stats, self._gauges)
        self.recent = RecentRequests()  # the dashboard's last requests
        pins = Pins(store, self.holds.limit)
        dashboard = Dashboard(engine, config.model_name, self.recent, self._gauges, pins.listing)
        self.events = EventStream(engine, config.events_queue)  # a fleet router's view (DESIGN §11)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/v1/kvtier/stats", self.stats, methods=["GET"]),
                self.events.route(),
                *dashboard.routes(),
                Admin(engine, self.recent, pins, self.tokenizer).mount(),  # every admin action: /v1/kvtier/admin/...
            ],
            # Starlette types every handler as taking any Exception although it dispatches by
            # class (Kludex/starlette#2417), so a handler of one class is a dict-item error.
            exception_handlers={
                APIError: self._api_error,  # type: ignore[dict-item]
                HTTPException: self._http_error,  # type: ignore[dict-item]
                Exception: self._internal_error,
            },
            middleware=[Middleware(Authenticate, tenancy=self.tenancy, anthropic_paths=ANTHROPIC_PATHS)],
            lifespan=self._lifespan,
        )

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self.engine.start()
        self.holds.sweep_every(1.0, self._closing)

    def close(self) -> None:
        """Cancel what is still running, stop the engine and flush the store to L3 (idempotent)."""
        self._closing.set()
        self.events.close()
        self.engine.stop(cancel=True)
        self.engine.close()

    def cancel_live(self) -> None:
        """Cancel every request in flight (from any thread): each ends at the engine's next
        step, a stream with an error event, a plain request with a 503."""
        for request in list(self._live.values()):
            request.cancel()

    @asynccontextmanager
    async def _lifespan(self, app: Starlette):
        # Every live stream holds a worker thread while it waits for a token.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, self.config.max_waiting + self.engine.config.max_running + 8)
        yield

    def _gauges(self) -> dict[str, int]:
        live = len(self._live)
        waiting = min(self.engine.scheduler.pending(), live)
        return {"waiting": waiting, "running": live - waiting}

    # -- OpenAI ------------------------------------------------------------------

    async def completions(self, http: HTTPRequest) -> Response:
        body = api.parse_body(await self._read(http), api.CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, str):
            check_text(self.text_limit, len(prompt.encode()), "prompt")
        tokens = await anyio.to_thread.run_sync(self.tokenizer.encode, prompt) if isinstance(prompt, str) else prompt
        return await self._openai(http, body, Prompt(list(tokens)), chat=False)

    async def chat_completions(self, http: HTTPRequest) -> Response:
        body = api.parse_body(await self._read(http), api.ChatCompletionRequest)
        prompt = await anyio.to_thread.run_sync(chat_prompt, self.tokenizer, body, self.text_limit)
        return await self._openai(http, body, prompt, chat=True)

    async def _openai(self, http: HTTPRequest, body, prompt: Prompt, chat: bool) -> Response:
        shape = responses.OpenAIShape(chat, self._model(body.model))
        params = SamplingParams(
            body.max_tokens or 0,
            body.temperature,
            body.top_p,
            seed=body.seed,
            forced=prompt.forced,
            banned=prompt.banned,
            **body.sampling(),
        )
        root = self.tenancy.root(http.state.caller, body.cache_salt, prompt.tokens)
        gen = await self._submit(
            prompt, params, body.stop_strings(), "prompt" if not chat else "messages", "call_", root, verbatim=not chat
        )
        gen.turn = (shape.id, body.prompt_cache_key or body.user or body.safety_identifier, None)
        if not body.stream:
            return JSONResponse(shape.response(await self._collect(gen, http)))

        async def events() -> AsyncIterator[str]:
            yield shape.chunk("", first=True)
            held: list[responses.TokenChoice] = []  # of tokens whose text is held back (a stop string may start)
            async for piece, calls in gen.pieces():
                held += gen.new_logprobs() or []
                if piece or calls:
                    yield shape.chunk(piece, logprobs=held if params.logprobs is not None else None, tool_calls=calls)
                    held = []
            try:
                done = await self._finished(gen)
            except APIError as err:
                for chunk in shape.error_chunks(err):
                    yield chunk
                return
            tail = held + done.logprobs if done.logprobs is not None else None
            for chunk in shape.final_chunks(done, body.include_usage, tail):
                yield chunk

        return self._sse(events(), gen)

    # -- Anthropic ------------------------------------------------------------------

    async def messages(self, http: HTTPRequest) -> Response:
        body = api.parse_body(await self._read(http), api.MessagesRequest)
        shape = responses.AnthropicShape(self._model(body.model))
        prompt = await anyio.to_thread.run_sync(self._anthropic_prompt, body)
        params = SamplingParams(
            body.max_tokens,
            body.temperature,
            body.top_p,
            top_k=body.top_k or 0,
            forced=prompt.forced,
            banned=prompt.banned,
        )
        root = self.tenancy.root(http.state.caller, body.cache_salt, prompt.tokens)
        gen = await self._submit(prompt, params, body.stop_sequences, "messages", "toolu_", root)
        previous = body.diagnostics.previous_message_id if body.diagnostics else None
        gen.turn = (shape.id, (body.metadata or {}).get("user_id"), previous)
        gen.diagnose = body.diagnostics is not None
        if not body.stream:
            return JSONResponse(shape.response(await self._collect(gen, http)))

        async def events() -> AsyncIterator[str]:
            started = False
            async for piece, calls in gen.pieces():
                if not started:  # the first token: the request was admitted, its sources are known
                    started = True
                    for event in shape.start_events(gen.prompt_usage()):
                        yield event
                if piece:
                    yield shape.delta_event(piece)
                for call in calls:
                    for event in shape.tool_events(call):
                        yield event
            try:
                done = await self._finished(gen)
            except APIError as err:
                for event in shape.error_events(err):
                    yield event
                return
            for event in (shape.start_events(done.prompt) if not started else []) + shape.final_events(done):
                yield event

        return self._sse(events(), gen)

    async def count_tokens(self, http: HTTPRequest) -> Response:
        """The prompt's token count, exactly as ``/v1/messages`` would render it."""
        body = api.parse_body(await self._read(http), api.CountTokensRequest)
        self._model(body.model)
        prompt = await anyio.to_thread.run_sync(self._anthropic_prompt, body)
        return JSONResponse({"input_tokens": len(prompt.tokens)})

    def _anthropic_prompt(self, body: api.AnthropicPrompt) -> Prompt:
        return anthropic_prompt(self.tokenizer, body, self.text_limit)

    # -- the rest of the API -----------------------------------------------------------

    async def models(self, http: HTTPRequest) -> Response:
        return JSONResponse(responses.models_list(self.config.model_name, self.created))

    async def model(self, http: HTTPRequest) -> Response:
        self._model(http.path_params["model"])
        return JSONResponse(responses.model_object(self.config.model_name, self.created))

    async def health(self, http: HTTPRequest) -> Response:
        """200 while the engine serves; "degraded", naming the tiers, while one of the
        store's answers slowly or not at all (requests recompute what it holds)."""
        store = self.engine.store
        degraded = store.accounts.degraded() if store is not None else []
        body = {"status": "degraded" if degraded else "ok", "model": self.config.model_name}
        return JSONResponse({**body, "degraded": degraded} if degraded else body)

    async def prometheus(self, http: HTTPRequest) -> Response:
        text = await anyio.to_thread.run_sync(self.metrics.render)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def stats(self, http: HTTPRequest) -> Response:
        stats = await anyio.to_thread.run_sync(self.engine.stats)
        return JSONResponse({**stats.to_json(), "server": self._gauges()})

    # -- steps shared by the endpoints ------------------------------------------------

    async def _read(self, http: HTTPRequest) -> bytes:
        """The body, refused with 413 as soon as it passes the limit, and with 408 when it
        has not all come within ``body_timeout_s``."""
        limit = self.config.max_body_bytes
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"body is {declared} bytes; the limit is {limit}", code="body_too_large")
        chunks, size = [], 0
        with anyio.move_on_after(self.config.body_timeout_s) as waited:
            async for chunk in http.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"body is over the limit of {limit} bytes", code="body_too_large")
                chunks.append(chunk)
        if waited.cancelled_caught:
            timeout = self.config.body_timeout_s
            raise APIError(408, f"body not received within {timeout:g} s ({size} bytes came)", code="body_timeout")
        return b"".join(chunks)

    def _model(self, name: str | None) -> str:
        if name is not None and name != self.config.model_name:
            raise APIError(
                404,
                f"model {name!r} is not served here (this server has {self.config.model_name!r})",
                param="model",
                code="model_not_found",
            )
        return self.config.model_name

    async def _submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        stops: list[str],
        param: str,
        call_ids: str,
        root: ChainRoot,
        verbatim: bool = False,
    ) -> Generation:
        """Check and submit; ``params.max_tokens`` 0 takes the server's default (capped by the
        context). ``call_ids`` starts the ids of the tool calls read from the answer; ``root``:
        where its keys start: its caller's (``Authenticate`` put it in the request's state),
        narrowed by the body's ``cache_salt`` (``tenancy``). A ``verbatim`` text (a
        completion's) keeps the space its first token starts with."""
        tokens = prompt.tokens
        if len(tokens) >= self.context:
            raise api.invalid(f"the prompt is {len(tokens)} tokens; this model's context is {self.context}", param)
        room = self.context - len(tokens)
        if params.max_tokens > room:
            raise api.invalid(
                f"max_tokens is {params.max_tokens}, but the {len(tokens)}-token prompt leaves room "
                f"for {room} in this model's context of {self.context}",
                "max_tokens",
            )
        if self.engine.scheduler.pending() >= self.config.max_waiting:
            raise APIError(
                429,
                f"{self.config.max_waiting} requests are already waiting; try again shortly",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        params.max_tokens = params.max_tokens or min(self.config.default_max_tokens, room)
        await anyio.to_thread.run_sync(self.holds.sweep)
        try:
            request = await anyio.to_thread.run_sync(self.engine.submit, tokens, params, root)
        except InputError as err:
            raise api.invalid(str(err), err.param or param) from None
        self._live[request.rid] = request
        calls = ToolCallText(self.tokenizer, prompt.tools, call_ids) if prompt.reads_calls else None
        return Generation(
            request,
            prompt,
            OutputText(verbatim_text(self.tokenizer.detokenizer) if verbatim else self.tokenizer.detokenizer, stops),
            self.engine.config.page_size,
            self.tokenizer,
            calls,
        )

    async def _collect(self, gen: Generation, http: HTTPRequest) -> Finished:
        """Run a request to its end; cancel it if the client goes away first."""
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(cancel_on_disconnect, http, gen.request)
                async for _ in gen.pieces():
                    pass
                group.cancel_scope.cancel()
            return await self._finished(gen)
        finally:
            self._end(gen)

    async def _finished(self, gen: Generation) -> Finished:
        """The outcome, with the pages it holds in the fast tiers (``holds``)."""
        done = gen.finished()
        done.held = await anyio.to_thread.run_sync(self._hold, gen, done)
        await anyio.to_thread.run_sync(self._diagnose, gen, done)
        return done

    def _diagnose(self, gen: Generation, done: Finished) -> None:
        """Compare the request with its conversation's previous turn: an INFO line if it
        recomputed more than a page of it, and Anthropic's ``cache_miss_reason`` when the
        request asked for ``diagnostics``."""
        if gen.turn is None:
            return
        turn_id, key, previous_id = gen.turn
        request = gen.request
        if gen.diagnose and previous_id is None:
            return  # Anthropic's first turn: nothing before it to compare with
        scope = request.root.own or b""  # a caller compares only with its own turns
        loss = self.conversations.loss(request.prompt, request.matched_tokens, key, previous_id, scope)
        if loss is not None:
            log_loss(turn_id, loss, gen.divergence())
        if gen.diagnose:
            known = self.conversations.known(previous_id, scope)
            reason = miss_reason(loss, known, gen.divergence(), gen.prompt.tools_digest)
            done.diagnostics = None if reason is None else {"cache_miss_reason": reason}

    def _hold(self, gen: Generation, done: Finished) -> dict[str, int] | None:
        """Hold the prompt up to its cache_control breakpoints for their TTLs, and an answer
        that ends in a tool call (prompt, answer and its partial page) for ``tool_warm_s``:
        the tokens held, by why; None when the request asked for neither."""
        request, page = gen.request, self.engine.config.page_size
        held: dict[str, int] = {}
        if gen.prompt.breakpoints:
            marks = gen.prompt.breakpoints
            held["cache_control"] = page * max(
                self.holds.hold("cache_control", request.keys[: n // page], ttl) for n, ttl in marks
            )
        if done.finish_reason == "tool_calls" and self.config.tool_warm_s > 0:
            keys = request.ended_in  # its pages and, last, its partial page
            full = len(keys) - (request.tail_tokens > 0)
            n = self.holds.hold(TOOL_WAIT, keys, self.config.tool_warm_s)
            held[TOOL_WAIT] = min(n, full) * page + (request.tail_tokens if n > full else 0)
        return held or None

    def _sse(self, events: AsyncIterator[str], gen: Generation) -> StreamingResponse:
        """A server-sent event stream; however it ends (done, client gone, never started), ``_end`` runs."""
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(self._end, gen),
        )

    def _end(self, gen: Generation) -> None:
        """The server is done with a request: cancel it (nothing happens to a finished one),
        forget it, count its latencies once, and remember the turn it answered."""
        request = gen.request
        request.cancel()
        self._live.pop(request.rid, None)
        if request.finish_reason in ("stop", "length") and gen.turn is not None:
            turn_id, key, _ = gen.turn
            sequence, scope = request.prompt + request.output, request.root.own or b""
            self.conversations.remember(turn_id, key, sequence, scope, gen.prompt.tools_digest)
        if request.t_first_token is not None:
            self.metrics.ttft.observe(request.t_first_token - request.t_submit)
        if request.t_admit is not None:
            self.metrics.queue.observe(request.t_admit - request.t_submit)
            self.recent.add(request)  # admitted: its sources and plan are known (the dashboard's ring)

    # -- errors ---------------------------------------------------------------------

    async def _api_error(self, http: HTTPRequest, err: APIError) -> Response:
        return JSONResponse(
            err.body(anthropic=http.url.path in ANTHROPIC_PATHS), status_code=err.status, headers=err.headers
        )

    async def _http_error(self, http: HTTPRequest, err: HTTPException) -> Response:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return await self._api_error(
            http, APIError(err.status_code, f"{http.method} {http.url.path}: {err.detail}", kind)
        )

    async def _internal_error(self, http: HTTPRequest, err: Exception) -> Response:
        log.exception("request to %s failed", http.url.path)
        return await self._api_error(http, APIError(500, f"internal error: {type(err).__name__}", "server_error"))
