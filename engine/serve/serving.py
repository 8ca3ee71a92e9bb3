"""The steps every generation endpoint shares (``KVTierServer.serving``): read the body,
check the model and the prompt against the context and the queue, submit, collect or
stream the answer, hold its pages, and end the request.

Invariants: every submitted request is in ``live`` until ``end`` runs, and ``end`` runs
once however the request ends (collected, streamed, client gone, never started): it
cancels the request (nothing happens to a finished one), so no batch slot or pin outlives
the HTTP request; a refused request (400, 404, 408, 413, 429) is never submitted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from starlette.background import BackgroundTask
from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from kvtier.tiers.page import ChainRoot

from ..engine import Engine
from ..limits import InputError, context_length
from ..request import Request, SamplingParams
from ..text import OutputText
from ..text import verbatim as verbatim_text
from . import api
from .api import APIError
from .conversations import Conversations, log_loss, miss_reason
from .generation import Generation, cancel_on_disconnect
from .holds import TOOL_WAIT, Holds
from .prometheus import ServerMetrics
from .prompt import Prompt
from .recent import RecentRequests
from .responses import Finished
from .server_config import ServerConfig
from .tools import ToolCallText

RETRY_AFTER_S = 1  # a 429's Retry-After: a batch slot frees as soon as one request ends


class Serving:
    """One server's requests in flight, from body to end, and what their ends feed:
    latency metrics, the dashboard's recent requests, conversations, holds."""

    def __init__(self, engine: Engine, config: ServerConfig, holds: Holds, recent: RecentRequests) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.loaded.tokenizer
        self.context = context_length(engine.loaded) or 32768
        self.holds = holds
        self.recent = recent  # the dashboard's last requests
        self.conversations = Conversations(engine.config.page_size)
        self.metrics = ServerMetrics(engine.stats, self.gauges)
        self.live: dict[int, Request] = {}  # by rid

    def gauges(self) -> dict[str, int]:
        live = len(self.live)
        waiting = min(self.engine.scheduler.pending(), live)
        return {"waiting": waiting, "running": live - waiting}

    def cancel_live(self) -> None:
        """Cancel every request in flight (from any thread): each answer ends now, a stream
        with an error event, a plain request with a 503, without waiting for the engine's
        step in progress (``Request.abandon``); the engine ends them at its next step."""
        for request in list(self.live.values()):
            request.abandon()

    async def read(self, http: HTTPRequest) -> bytes:
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

    def model(self, name: str | None) -> str:
        """The served model's id; 404 for any other name."""
        if name is not None and name != self.config.model_name:
            raise APIError(
                404,
                f"model {name!r} is not served here (this server has {self.config.model_name!r})",
                param="model",
                code="model_not_found",
            )
        return self.config.model_name

    async def submit(
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
        self.live[request.rid] = request
        calls = ToolCallText(self.tokenizer, prompt.tools, call_ids) if prompt.reads_calls else None
        return Generation(
            request,
            prompt,
            OutputText(verbatim_text(self.tokenizer.detokenizer) if verbatim else self.tokenizer.detokenizer, stops),
            self.engine.config.page_size,
            self.tokenizer,
            calls,
        )

    async def collect(self, gen: Generation, http: HTTPRequest) -> Finished:
        """Run a request to its end; cancel it if the client goes away first."""
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(cancel_on_disconnect, http, gen.request)
                async for _ in gen.pieces():
                    pass
                group.cancel_scope.cancel()
            return await self.finished(gen)
        finally:
            self.end(gen)

    async def finished(self, gen: Generation) -> Finished:
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

    def sse(self, events: AsyncIterator[str], gen: Generation) -> StreamingResponse:
        """A server-sent event stream; however it ends (done, client gone, never started), ``end`` runs."""
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(self.end, gen),
        )

    def end(self, gen: Generation) -> None:
        """The server is done with a request: cancel it (nothing happens to a finished one),
        forget it, count its latencies once, and remember the turn it answered."""
        request = gen.request
        request.cancel()
        self.live.pop(request.rid, None)
        if request.finish_reason in ("stop", "length") and gen.turn is not None:
            turn_id, key, _ = gen.turn
            sequence, scope = request.prompt + request.output, request.root.own or b""
            self.conversations.remember(turn_id, key, sequence, scope, gen.prompt.tools_digest)
        if request.t_first_token is not None:
            self.metrics.ttft.observe(request.t_first_token - request.t_submit)
        if request.t_admit is not None:
            self.metrics.queue.observe(request.t_admit - request.t_submit)
            self.recent.add(request)  # admitted: its sources and plan are known (the dashboard's ring)
