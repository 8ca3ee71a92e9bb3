"""The Anthropic-compatible endpoints (``/v1/messages``, ``/v1/messages/count_tokens``):
each parses its body (``api``), renders the prompt as ``/v1/messages`` does, and hands
the request to ``Serving``; a stream is Anthropic's events, its start sent with the
first token (the request was admitted: its sources are known)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..limits import TextLimit
from ..request import SamplingParams
from . import api, responses
from .api import APIError
from .prompt import Prompt, anthropic_prompt
from .serving import Serving
from .tenancy import Tenancy

ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # their errors are Anthropic's shape


class AnthropicRoutes:
    """Anthropic's API family on one server's ``Serving``."""

    def __init__(self, serving: Serving, tenancy: Tenancy, text_limit: TextLimit | None) -> None:
        self.serving = serving
        self.tenancy = tenancy
        self.text_limit = text_limit  # refuses huge prompts untokenized

    def routes(self) -> list[Route]:
        return [
            Route(ANTHROPIC_PATHS[0], self.messages, methods=["POST"]),
            Route(ANTHROPIC_PATHS[1], self.count_tokens, methods=["POST"]),
        ]

    async def messages(self, http: HTTPRequest) -> Response:
        serving = self.serving
        body = api.parse_body(await serving.read(http), api.MessagesRequest)
        shape = responses.AnthropicShape(serving.model(body.model))
        prompt = await anyio.to_thread.run_sync(self._prompt, body)
        params = SamplingParams(
            body.max_tokens,
            body.temperature,
            body.top_p,
            top_k=body.top_k or 0,
            forced=prompt.forced,
            banned=prompt.banned,
        )
        root = self.tenancy.root(http.state.caller, body.cache_salt, prompt.tokens)
        gen = await serving.submit(prompt, params, body.stop_sequences, "messages", "toolu_", root)
        previous = body.diagnostics.previous_message_id if body.diagnostics else None
        gen.turn = (shape.id, (body.metadata or {}).get("user_id"), previous)
        gen.diagnose = body.diagnostics is not None
        if not body.stream:
            return JSONResponse(shape.response(await serving.collect(gen, http)))

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
                done = await serving.finished(gen)
            except APIError as err:
                for event in shape.error_events(err):
                    yield event
                return
            for event in (shape.start_events(done.prompt) if not started else []) + shape.final_events(done):
                yield event

        return serving.sse(events(), gen)

    async def count_tokens(self, http: HTTPRequest) -> Response:
        """The prompt's token count, exactly as ``/v1/messages`` would render it."""
        body = api.parse_body(await self.serving.read(http), api.CountTokensRequest)
        self.serving.model(body.model)
        prompt = await anyio.to_thread.run_sync(self._prompt, body)
        return JSONResponse({"input_tokens": len(prompt.tokens)})

    def _prompt(self, body: api.AnthropicPrompt) -> Prompt:
        return anthropic_prompt(self.serving.tokenizer, body, self.text_limit)
