"""One submitted request as the server follows it: its output text, cut at the first stop
string, split into text and tool calls where the request has tools (``tools``), the
log-probabilities of its tokens when it asked for them, and its outcome.

Tokens are read from ``Request.stream`` in a worker thread, so the event loop never
waits on the engine; a stop string cancels the request, which the engine ends at its
next step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
from mlx_lm.tokenizer_utils import TokenizerWrapper
from starlette.requests import Request as HTTPRequest

from ..divergence import divergence
from ..request import Request
from ..text import OutputText
from . import responses
from .api import APIError
from .prompt import Prompt
from .responses import Finished, PromptUsage
from .tools import ToolCall, ToolCallText


class Generation:
    """One submitted request as the server follows it: its text, cut at a stop string, and
    the log-probabilities of its tokens when it asked for them."""

    def __init__(
        self,
        request: Request,
        prompt: Prompt,
        text: OutputText,
        page_size: int,
        tokenizer: TokenizerWrapper,
        calls: ToolCallText | None = None,
    ) -> None:
        self.request = request
        self.prompt = prompt
        self.turn: tuple[str, str | None, str | None] | None = None  # response id, conversation key, previous id
        self.diagnose = False  # the request asked for Anthropic's diagnostics
        self._report: dict | None = None
        self.text = text
        self.calls = calls  # where the request has tools
        self.plain = ""  # the text handed out, tool calls left out
        self.page_size = page_size
        self.tokenizer = tokenizer
        self.tokens = 0  # generated tokens read, up to the one that completed a stop string
        self._described = 0  # of them, those whose logprobs were handed out

    def new_logprobs(self) -> list[responses.TokenChoice] | None:
        """The logprobs of the tokens read since the last call (None: none were asked for).
        The engine records a token's logprobs before it streams the token."""
        if self.request.params.logprobs is None:
            return None
        start, self._described = self._described, self.tokens
        decode, request = self.tokenizer.decode, self.request
        return [
            responses.TokenChoice(decode([token]), entry.logprob, [(decode([t]), lp) for t, lp in entry.top])
            for token, entry in zip(request.output[start : self.tokens], request.logprobs[start : self.tokens])
        ]

    async def deltas(self) -> AsyncIterator[str]:
        """Pieces of text as tokens arrive (may be empty); ends with the request or a stop string."""
        stream = self.request.stream()
        while (token := await anyio.to_thread.run_sync(next, stream, None, abandon_on_cancel=True)) is not None:
            self.tokens += 1
            yield self.text.add(token)
            if self.text.stop_string is not None:
                self.request.cancel()  # the engine ends it at its next step
                return
        yield self.text.finish()

    async def pieces(self) -> AsyncIterator[tuple[str, list[ToolCall]]]:
        """As ``deltas``, each piece split into its text and the tool calls it completed."""
        async for text in self.deltas():
            text, calls = self.calls.add(text) if self.calls else (text, [])
            self.plain += text
            yield text, calls
        if self.calls:
            text, calls = self.calls.finish()
            self.plain += text
            yield text, calls

    def prompt_usage(self) -> PromptUsage:
        """Where the prompt came from (known once the request was admitted)."""
        request = self.request
        plan = request.plan.to_dict() if request.plan else None
        usage = PromptUsage(len(request.prompt), request.sources(), self.page_size, plan, self.divergence())
        stored = self.prompt.cached_prefix // self.page_size * self.page_size  # full pages up to the breakpoint
        usage.cache_creation = max(0, stored - usage.restored)
        return usage

    def divergence(self) -> dict:
        """Where the prompt left the cache, and the request's message that holds that token
        (worked out once, after admission)."""
        if self._report is None:
            report = divergence(self.request, self.tokenizer)
            report["message"], report["role"] = self.prompt.message_at(self.tokenizer, report["token"])
            self._report = report
        return self._report

    def finished(self) -> Finished:
        """The outcome once ``deltas`` is exhausted; an engine failure is a 500."""
        if self.text.stop_string is not None:
            reason = "stop"
        elif self.request.finish_reason in ("stop", "length") and not self.request.abandoned:
            reason = self.request.finish_reason
        elif self.request.finish_reason == "error":
            raise APIError(500, f"generation failed: {self.request.error}", "server_error")
        else:
            raise APIError(503, "the request was cancelled (server shutting down)", "server_error")
        calls = self.calls.calls if self.calls else []
        return Finished(
            self.plain,
            self.tokens,
            "tool_calls" if calls and reason == "stop" else reason,
            self.text.stop_string,
            self.prompt_usage(),
            self.new_logprobs(),
            calls,
        )


async def cancel_on_disconnect(http: HTTPRequest, request: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
    request.cancel()
