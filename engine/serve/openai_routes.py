"""The OpenAI-compatible endpoints (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``): each parses its body (``api``), renders and tokenizes the prompt, and
hands the request to ``Serving``; a stream is OpenAI's chunks, ended by its final ones
(or its error chunks when the request failed after it started)."""

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
from .prompt import Prompt, chat_prompt, check_text
from .serving import Serving
from .tenancy import Tenancy


class OpenAIRoutes:
    """OpenAI's API family on one server's ``Serving``."""

    def __init__(self, serving: Serving, tenancy: Tenancy, text_limit: TextLimit | None, created: int) -> None:
        self.serving = serving
        self.tenancy = tenancy
        self.tokenizer = serving.tokenizer
        self.text_limit = text_limit  # refuses huge prompts untokenized
        self.created = created  # the models' creation time, as /v1/models reports it

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
        ]

    async def completions(self, http: HTTPRequest) -> Response:
        body = api.parse_body(await self.serving.read(http), api.CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, str):
            check_text(self.text_limit, len(prompt.encode()), "prompt")
        tokens = await anyio.to_thread.run_sync(self.tokenizer.encode, prompt) if isinstance(prompt, str) else prompt
        return await self._answer(http, body, Prompt(list(tokens)), chat=False)

    async def chat_completions(self, http: HTTPRequest) -> Response:
        body = api.parse_body(await self.serving.read(http), api.ChatCompletionRequest)
        prompt = await anyio.to_thread.run_sync(chat_prompt, self.tokenizer, body, self.text_limit)
        return await self._answer(http, body, prompt, chat=True)

    async def _answer(self, http: HTTPRequest, body, prompt: Prompt, chat: bool) -> Response:
        serving = self.serving
        shape = responses.OpenAIShape(chat, serving.model(body.model))
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
        gen = await serving.submit(
            prompt, params, body.stop_strings(), "prompt" if not chat else "messages", "call_", root, verbatim=not chat
        )
        gen.turn = (shape.id, body.prompt_cache_key or body.user or body.safety_identifier, None)
        if not body.stream:
            return JSONResponse(shape.response(await serving.collect(gen, http)))

        async def events() -> AsyncIterator[str]:
            yield shape.chunk("", first=True)
            held: list[responses.TokenChoice] = []  # of tokens whose text is held back (a stop string may start)
            async for piece, calls in gen.pieces():
                held += gen.new_logprobs() or []
                if piece or calls:
                    yield shape.chunk(piece, logprobs=held if params.logprobs is not None else None, tool_calls=calls)
                    held = []
            try:
                done = await serving.finished(gen)
            except APIError as err:
                for chunk in shape.error_chunks(err):
                    yield chunk
                return
            tail = held + done.logprobs if done.logprobs is not None else None
            for chunk in shape.final_chunks(done, body.include_usage, tail):
                yield chunk

        return serving.sse(events(), gen)

    async def models(self, http: HTTPRequest) -> Response:
        return JSONResponse(responses.models_list(self.serving.config.model_name, self.created))

    async def model(self, http: HTTPRequest) -> Response:
        self.serving.model(http.path_params["model"])
        return JSONResponse(responses.model_object(self.serving.config.model_name, self.created))
