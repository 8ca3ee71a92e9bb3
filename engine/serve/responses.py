"""What ``kvtier serve`` answers (DESIGN §8a): usage objects, responses, SSE chunks and
Anthropic events, from a request's outcome, a :class:`Finished`.

Usage reports where every prompt token came from: ``prompt_tokens_details.sources``
(``L1``, ``L2``, ``L3``, ``recomputed``) sums to ``prompt_tokens`` and ``cached_tokens``
is the restored part, ``L1 + L2 + L3``. Anthropic's ``cache_read_input_tokens`` is the
same restored count, ``cache_creation_input_tokens`` the tokens computed (and stored) up
to the request's last ``cache_control`` breakpoint, and ``input_tokens`` the rest, so
no token counts twice.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .api import APIError
from .tools import ToolCall

RESTORED = ("L1", "L2", "L3")


# -- outcomes and usage -------------------------------------------------------------


@dataclass
class PromptUsage:
    """Where a prompt's tokens came from, known once the request is admitted."""

    tokens: int
    sources: dict[str, int]  # L1, L2, L3, recomputed: sums to ``tokens``
    page_size: int
    plan: dict | None  # RestorePlan.to_dict(); None without a store
    divergence: dict | None = None  # where the prompt left the cache (engine.divergence, with its message)
    cache_creation: int = 0  # recomputed tokens up to the last cache_control breakpoint

    @property
    def restored(self) -> int:
        return sum(self.sources[s] for s in RESTORED)


@dataclass
class TokenChoice:
    """One output token's log-probability and the best alternatives at its place, as text."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class Finished:
    """What the server knows once a request is over."""

    text: str
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "tool_calls" (stopped after calls)
    stop_string: str | None  # the stop string that ended it, if one did
    prompt: PromptUsage
    logprobs: list[TokenChoice] | None = None  # when the request asked for them
    tool_calls: list[ToolCall] = field(default_factory=list)  # parsed; ``text`` is what is left
    held: dict[str, int] | None = None  # tokens now held in the fast tiers, by why (``holds``)
    diagnostics: dict | None = None  # Anthropic's, when asked for and the prompt missed


def usage(done: Finished) -> dict:
    """OpenAI usage with the per-source breakdown, and kvtier's plan under its own key."""
    prompt = done.prompt
    return {
        "prompt_tokens": prompt.tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": prompt.tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": prompt.restored, "sources": prompt.sources},
        "kvtier": _kvtier(done.prompt, done.held),
    }


def _kvtier(prompt: PromptUsage, held: dict[str, int] | None, **extra: Any) -> dict:
    """kvtier's own usage: the plan, where the prompt left the cache, what is held."""
    usage = {
        **extra,
        "page_size": prompt.page_size,
        "plan": prompt.plan,
        "divergence": prompt.divergence,
        "cache_creation_tokens": prompt.cache_creation,
    }
    return usage if held is None else {**usage, "held": held}


def anthropic_usage(prompt: PromptUsage, output_tokens: int, held: dict[str, int] | None = None) -> dict:
    """``cache_read_input_tokens`` are the restored tokens, ``cache_creation_input_tokens``
    those computed up to the last breakpoint, ``input_tokens`` the rest."""
    return {
        "input_tokens": prompt.tokens - prompt.restored - prompt.cache_creation,
        "cache_read_input_tokens": prompt.restored,
        "cache_creation_input_tokens": prompt.cache_creation,
        "output_tokens": output_tokens,
        "kvtier": _kvtier(prompt, held, sources=prompt.sources),
    }


# -- OpenAI responses and chunks -------------------------------------------------------


def _utf8(token: str) -> list[int] | None:
    """A token's bytes, where its text holds them (a token that is part of a character has none)."""
    return None if "\ufffd" in token else list(token.encode())


class OpenAIShape:
    """Responses and SSE chunks of one OpenAI request (completion or chat)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offset = 0  # characters of the completion's tokens so far: its text_offset
        self._calls = 0  # tool calls streamed so far: the next one's index

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def logprobs(self, tokens: list[TokenChoice] | None) -> dict | None:
        """OpenAI's ``logprobs`` of a choice or chunk: chat's ``content`` list, or the
        completions API's four parallel lists; None when the request asked for none."""
        if tokens is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": t.token,
                        "logprob": t.logprob,
                        "bytes": _utf8(t.token),
                        "top_logprobs": [{"token": a, "logprob": lp, "bytes": _utf8(a)} for a, lp in t.top],
                    }
                    for t in tokens
                ],
                "refusal": None,
            }
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t.token)
        return {
            "tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [dict(t.top) for t in tokens],
            "text_offset": offsets,
        }

    def response(self, done: Finished) -> dict:
        logprobs = self.logprobs(done.logprobs)
        if self.chat:
            message: dict = {"role": "assistant", "content": done.text or (None if done.tool_calls else "")}
            if done.tool_calls:
                message["tool_calls"] = [call.openai() for call in done.tool_calls]
            choice = {"index": 0, "message": message, "finish_reason": done.finish_reason, "logprobs": logprobs}
            return self._envelope("chat.completion", [choice], usage=usage(done))
        choice = {"index": 0, "text": done.text, "finish_reason": done.finish_reason, "logprobs": logprobs}
        return self._envelope("text_completion", [choice], usage=usage(done))

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: list[TokenChoice] | None = None,
        tool_calls: list[ToolCall] | None = None,
    ) -> str:
        """One chunk; ``logprobs`` are those of the tokens whose text it brings. A tool call
        comes whole in one ``delta.tool_calls`` entry (OpenAI's clients join the pieces of
        one index, so a single piece is a complete call to them)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [call.openai(self._calls + i) for i, call in enumerate(tool_calls)]
                self._calls += len(tool_calls)
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": self.logprobs(logprobs)}
            return sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": self.logprobs(logprobs)}
        return sse(self._envelope("text_completion", [choice]))

    def final_chunks(self, done: Finished, include_usage: bool, logprobs: list[TokenChoice] | None = None) -> list[str]:
        """The chunk with the finish reason (and the logprobs of tokens no chunk brought yet),
        the usage (its own chunk when the client asked for ``include_usage``, as OpenAI
        sends it; else on the last chunk), then ``[DONE]``."""
        last = json.loads(self.chunk("", done.finish_reason, logprobs=logprobs)[len("data: ") :])
        if include_usage:
            tail = [sse(last), sse(self._envelope(last["object"], [], usage=usage(done)))]
        else:
            tail = [sse({**last, "usage": usage(done)})]
        return tail + ["data: [DONE]\n\n"]

    @staticmethod
    def error_chunks(err: APIError) -> list[str]:
        return [sse(err.body()), "data: [DONE]\n\n"]


def sse(obj: dict, event: str | None = None) -> str:
    data = f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
    return f"event: {event}\n{data}" if event else data


# -- Anthropic responses and events ----------------------------------------------------

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _stop_reason(done: Finished) -> str:
    return "stop_sequence" if done.stop_string is not None else _STOP_REASONS[done.finish_reason]


class AnthropicShape:
    """The message and the event stream of one Anthropic Messages request."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"
        self._open: int | None = None  # the index of the text block being streamed, if one is open
        self._blocks = 0  # content blocks started

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def response(self, done: Finished) -> dict:
        text = [{"type": "text", "text": done.text}] if done.text or not done.tool_calls else []
        message = self._message(
            text + [call.anthropic() for call in done.tool_calls],
            _stop_reason(done),
            done.stop_string,
            anthropic_usage(done.prompt, done.completion_tokens, done.held),
        )
        return message if done.diagnostics is None else {**message, "diagnostics": done.diagnostics}

    def start_events(self, prompt: PromptUsage) -> list[str]:
        """``message_start`` (with the prompt's cache split) and the first text block's start."""
        message = self._message([], None, None, anthropic_usage(prompt, 0))
        return [sse({"type": "message_start", "message": message}, "message_start"), *self._start_text()]

    def _start_text(self) -> list[str]:
        self._open, self._blocks = self._blocks, self._blocks + 1
        block = {"type": "content_block_start", "index": self._open, "content_block": {"type": "text", "text": ""}}
        return [sse(block, "content_block_start")]

    def _stop_block(self, index: int | None) -> list[str]:
        return [] if index is None else [sse({"type": "content_block_stop", "index": index}, "content_block_stop")]

    def delta_event(self, text: str) -> str:
        """Text, in the open text block (a new one after a tool call)."""
        start = self._start_text() if self._open is None else []
        delta = {"type": "content_block_delta", "index": self._open, "delta": {"type": "text_delta", "text": text}}
        return "".join([*start, sse(delta, "content_block_delta")])

    def tool_events(self, call: ToolCall) -> list[str]:
        """A ``tool_use`` block as Anthropic streams it: its start with an empty input, the
        input as one ``input_json_delta``, its stop (the text block before it is closed)."""
        closed, self._open = self._stop_block(self._open), None
        index, self._blocks = self._blocks, self._blocks + 1
        start = {"type": "content_block_start", "index": index, "content_block": call.anthropic(with_input=False)}
        json_delta = {"type": "input_json_delta", "partial_json": call.arguments_json()}
        return [
            *closed,
            sse(start, "content_block_start"),
            sse({"type": "content_block_delta", "index": index, "delta": json_delta}, "content_block_delta"),
            *self._stop_block(index),
        ]

    def final_events(self, done: Finished) -> list[str]:
        delta = {"stop_reason": _stop_reason(done), "stop_sequence": done.stop_string}
        closed, self._open = self._stop_block(self._open), None
        return [
            *closed,
            sse(
                {
                    "type": "message_delta",
                    "delta": delta,
                    "usage": anthropic_usage(done.prompt, done.completion_tokens, done.held),
                },
                "message_delta",
            ),
            sse({"type": "message_stop"}, "message_stop"),
        ]

    @staticmethod
    def error_events(err: APIError) -> list[str]:
        return [sse(err.body(anthropic=True), "error")]


# -- models list ---------------------------------------------------------------------


def model_object(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "kvtier"}


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [model_object(model, created)]}
