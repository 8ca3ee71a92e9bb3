"""The wire shapes of ``kvtier serve`` (DESIGN §8a): request bodies and their checks,
usage objects, responses, SSE chunks and Anthropic events, and error objects.

Nothing here knows the engine: the server (``engine/server.py``) turns a checked body
into tokens and sampling settings, runs them, and hands the outcome, a :class:`Finished`,
back to the builders below.

Usage reports where every prompt token came from: ``prompt_tokens_details.sources``
(``L1``, ``L2``, ``L3``, ``recomputed``) sums to ``prompt_tokens`` and ``cached_tokens``
is the restored part, ``L1 + L2 + L3``. Anthropic's ``cache_read_input_tokens`` is the
same restored count and ``input_tokens`` the rest, so the two never count a token twice.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

RESTORED = ("L1", "L2", "L3")

# -- errors -----------------------------------------------------------------------


class APIError(Exception):
    """An answer other than 200: one status and one error object, never a traceback."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self, anthropic: bool = False) -> dict:
        """OpenAI's error object; Anthropic clients read the same ``error`` with ``type: error`` beside it."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"type": "error", "error": error} if anthropic else {"error": error}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# -- request bodies ---------------------------------------------------------------


class _Body(BaseModel):
    # Strict: a string is not a number, a number is not a string. Unknown fields are
    # ignored, as clients send many (user, logprobs: false, metadata, ...).
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise invalid("stop strings must not be empty", "stop")
        return stops

    def checked(self) -> "_OpenAISampling":
        if self.n != 1:
            raise invalid("only n = 1 is supported", "n")
        self.stop_strings()
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[int]]

    def checked(self) -> "CompletionRequest":
        if not self.prompt:
            raise invalid("prompt must not be empty", "prompt")
        return super().checked()


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    model_config = ConfigDict(strict=True, extra="allow")  # tool_calls, name, ... reach the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def for_template(self) -> dict:
        message = self.model_dump(exclude_none=True)
        message["content"] = _joined(self.content)
        return message


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    tools: list[dict] | None = None

    def checked(self) -> "ChatCompletionRequest":
        super().checked()
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


class ToolUse(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextPart]] = ""
    is_error: bool = False


AnthropicBlock = Union[TextPart, ToolUse, ToolResult]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[AnthropicBlock]]

    def for_template(self) -> dict:
        """One chat-template message: text as it is, tool calls and results as JSON text."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        parts = []
        for block in self.content:
            if isinstance(block, TextPart):
                parts.append(block.text)
            elif isinstance(block, ToolUse):
                parts.append(json.dumps({"tool_use": block.name, "id": block.id, "input": block.input}))
            else:
                parts.append(json.dumps({"tool_result": block.tool_use_id, "content": _joined(block.content),
                                         "is_error": block.is_error}))
        return {"role": self.role, "content": "\n".join(parts)}


class MessagesRequest(_Body):
    """Anthropic Messages API body."""

    model: str | None = None
    max_tokens: int = Field(gt=0)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[TextPart], None] = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop_sequences: list[str] = Field(default_factory=list)
    stream: bool = False
    tools: list[dict] | None = None

    def checked(self) -> "MessagesRequest":
        if any(not s for s in self.stop_sequences):
            raise invalid("stop_sequences must not hold empty strings", "stop_sequences")
        return self

    def template_messages(self) -> list[dict]:
        system = [{"role": "system", "content": _joined(self.system)}] if self.system else []
        return system + [m.for_template() for m in self.messages]


def _joined(content: str | list[TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


_FIELDS = {name for body in (CompletionRequest, ChatCompletionRequest, MessagesRequest, StreamOptions, ChatMessage,
                              TextPart, ToolUse, ToolResult, AnthropicMessage) for name in body.model_fields}


def _field_path(loc: tuple) -> str:
    """``messages.0.content`` from pydantic's location, without its union-member tags (``str``, ``list[int]``)."""
    return ".".join(str(part) for part in loc if isinstance(part, int) or part in _FIELDS)


def parse_body(raw: bytes, model: type[_Body]) -> Any:
    """A checked request body, or the 400 that says what is wrong with it (one line)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise invalid(f"body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise invalid("body must be a JSON object")
    try:
        return model.model_validate(data).checked()
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = _field_path(first["loc"]) or None
        raise invalid(f"{param}: {first['msg']}" if param else first["msg"], param) from None


# -- outcomes and usage -------------------------------------------------------------


@dataclass
class PromptUsage:
    """Where a prompt's tokens came from, known once the request is admitted."""

    tokens: int
    sources: dict[str, int]  # L1, L2, L3, recomputed: sums to ``tokens``
    page_size: int
    plan: dict | None  # RestorePlan.to_dict(); None without a store

    @property
    def restored(self) -> int:
        return sum(self.sources[s] for s in RESTORED)


@dataclass
class Finished:
    """What the server knows once a request is over."""

    text: str
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stop_string: str | None  # the stop string that ended it, if one did
    prompt: PromptUsage


def usage(done: Finished) -> dict:
    """OpenAI usage with the per-source breakdown, and kvtier's plan under its own key."""
    prompt = done.prompt
    return {
        "prompt_tokens": prompt.tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": prompt.tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": prompt.restored, "sources": prompt.sources},
        "kvtier": {"page_size": prompt.page_size, "plan": prompt.plan},
    }


def anthropic_usage(prompt: PromptUsage, output_tokens: int) -> dict:
    """``cache_read_input_tokens`` are the restored tokens, ``input_tokens`` the rest."""
    return {
        "input_tokens": prompt.tokens - prompt.restored,
        "cache_read_input_tokens": prompt.restored,
        "cache_creation_input_tokens": 0,
        "output_tokens": output_tokens,
        "kvtier": {"sources": prompt.sources, "page_size": prompt.page_size, "plan": prompt.plan},
    }


# -- OpenAI responses and chunks -------------------------------------------------------


class OpenAIShape:
    """Responses and SSE chunks of one OpenAI request (completion or chat)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, done: Finished) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                      "finish_reason": done.finish_reason, "logprobs": None}
            return self._envelope("chat.completion", [choice], usage=usage(done))
        choice = {"index": 0, "text": done.text, "finish_reason": done.finish_reason, "logprobs": None}
        return self._envelope("text_completion", [choice], usage=usage(done))

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return sse(self._envelope("text_completion", [choice]))

    def final_chunks(self, done: Finished, include_usage: bool) -> list[str]:
        """The chunk with the finish reason, the usage (its own chunk when the client asked
        for ``include_usage``, as OpenAI sends it; else on the last chunk), then ``[DONE]``."""
        last = json.loads(self.chunk("", done.finish_reason)[len("data: "):])
        if include_usage:
            tail = [sse(last), sse(self._envelope(last["object"], [], usage=usage(done)))]
        else:
            tail = [sse({**last, "usage": usage(done)})]
        return tail + ["data: [DONE]\n\n"]

    def error_chunks(self, err: APIError) -> list[str]:
        return [sse(err.body()), "data: [DONE]\n\n"]


def sse(obj: dict, event: str | None = None) -> str:
    data = f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
    return f"event: {event}\n{data}" if event else data


# -- Anthropic responses and events ----------------------------------------------------

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def _stop_reason(done: Finished) -> str:
    return "stop_sequence" if done.stop_string is not None else _STOP_REASONS[done.finish_reason]


class AnthropicShape:
    """The message and the event stream of one Anthropic Messages request."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def response(self, done: Finished) -> dict:
        return self._message([{"type": "text", "text": done.text}], _stop_reason(done), done.stop_string,
                             anthropic_usage(done.prompt, done.completion_tokens))

    def start_events(self, prompt: PromptUsage) -> list[str]:
        """``message_start`` (with the prompt's cache split) and the text block's start."""
        message = self._message([], None, None, anthropic_usage(prompt, 0))
        return [sse({"type": "message_start", "message": message}, "message_start"),
                sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                    "content_block_start")]

    @staticmethod
    def delta_event(text: str) -> str:
        return sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
                   "content_block_delta")

    def final_events(self, done: Finished) -> list[str]:
        delta = {"stop_reason": _stop_reason(done), "stop_sequence": done.stop_string}
        return [sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
                sse({"type": "message_delta", "delta": delta, "usage": anthropic_usage(done.prompt, done.completion_tokens)},
                    "message_delta"),
                sse({"type": "message_stop"}, "message_stop")]

    @staticmethod
    def error_events(err: APIError) -> list[str]:
        return [sse(err.body(anthropic=True), "error")]


# -- models list ---------------------------------------------------------------------


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "kvtier"}]}
