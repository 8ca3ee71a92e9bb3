"""Request bodies as the chat template takes them (DESIGN §8a): OpenAI-shaped messages
(``tool_calls`` with arguments as a mapping, ``tool`` messages) and function tools.

Both APIs come to one shape, the one Hugging Face chat templates are written for, so
one template renders either. Nothing is reordered or re-serialised on the way: tool-call
arguments are parsed from the client's JSON with their key order kept, so a history
renders to the same tokens turn after turn, and the previous turn's prompt and answer
stay a stored prefix of the next.
"""

from __future__ import annotations

import json

from .api import (
    AnthropicMessage,
    AnthropicPrompt,
    CacheControl,
    ChatCompletionRequest,
    TextPart,
    ToolResult,
    ToolUse,
    invalid,
)
from .holds import TTLS
from .tools import AUTO, NONE, REQUIRED, ToolChoice

ERROR_PREFIX = "Error: "  # before an Anthropic tool_result marked is_error, which templates cannot show


def joined(content: str | list[TextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


# -- OpenAI ------------------------------------------------------------------------


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """The messages, each with its ``origin`` (see :func:`origins`)."""
    messages = []
    for i, message in enumerate(body.messages):
        rendered = message.model_dump(exclude_none=True)
        rendered["content"] = joined(message.content)
        if message.tool_calls:
            rendered["tool_calls"] = [
                _call(call.id, call.function.name, _arguments(call.function.arguments, f"messages.{i}.tool_calls.{j}"))
                for j, call in enumerate(message.tool_calls)
            ]
        messages.append(rendered)
    return messages


def chat_origins(body: ChatCompletionRequest) -> list[tuple[int | None, str]]:
    """Per template message, the index and role of the request's message it came from."""
    return [(i, message.role) for i, message in enumerate(body.messages)]


def chat_tools(body: ChatCompletionRequest) -> list[dict] | None:
    return [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None


def chat_tool_choice(body: ChatCompletionRequest) -> ToolChoice:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return ToolChoice(choice or AUTO)
    return ToolChoice("function", choice.function.name)


def chat_breakpoints(body: ChatCompletionRequest) -> list[tuple[int, float]]:
    """``cache_control`` on a message's text parts, or on the body (the whole prompt), as
    (the template message it ends, its TTL in seconds)."""
    marks = [
        (i, _ttl(part.cache_control))
        for i, message in enumerate(body.messages)
        if isinstance(message.content, list)
        for part in message.content
        if part.cache_control is not None
    ]
    return marks + ([(len(body.messages) - 1, _ttl(body.cache_control))] if body.cache_control else [])


def _ttl(control: CacheControl) -> float:
    return TTLS[control.ttl or "5m"]


def chat_has_tool_history(body: ChatCompletionRequest) -> bool:
    return any(m.tool_calls or m.role == "tool" for m in body.messages)


def _arguments(text: str, param: str) -> object:
    """A call's arguments from the client's JSON text, key order kept ("" is no arguments)."""
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError as err:
        raise invalid(f"{param}.function.arguments: not valid JSON ({err})", f"{param}.function.arguments") from None


def _call(call_id: str, name: str, arguments: object) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- Anthropic -----------------------------------------------------------------------


def anthropic_messages(body: AnthropicPrompt) -> tuple[list[dict], list[tuple[int | None, str]]]:
    """The system prompt, then each message: an assistant's ``tool_use`` blocks become its
    ``tool_calls``, a user's ``tool_result`` blocks ``tool`` messages, in the order sent;
    and per template message, the index and role of the request's message it came from
    (the system prompt's index is None: it is not one of the ``messages``)."""
    messages = [{"role": "system", "content": joined(body.system)}] if body.system else []
    origins: list[tuple[int | None, str]] = [(None, "system")] * len(messages)
    for i, message in enumerate(body.messages):
        rendered = _anthropic_message(message)
        messages += rendered
        origins += [(i, message.role)] * len(rendered)
    return messages, origins


def _anthropic_message(message: AnthropicMessage) -> list[dict]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        text = "".join(block.text for block in message.content if isinstance(block, TextPart))
        calls = [_call(b.id, b.name, b.input) for b in message.content if isinstance(b, ToolUse)]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    out: list[dict] = []
    for block in message.content:
        if isinstance(block, ToolResult):
            content = (ERROR_PREFIX if block.is_error else "") + joined(block.content)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, TextPart):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += block.text
            else:
                out.append({"role": "user", "content": block.text})
        else:
            raise invalid("messages: a user message cannot hold tool_use blocks", "messages")
    return out


def anthropic_breakpoints(body: AnthropicPrompt, origins: list[tuple[int | None, str]]) -> list[tuple[int, float]]:
    """``cache_control`` on tools, system blocks, message blocks or the body, as (the
    template message it ends, its TTL in seconds). Tools render inside the first
    message's turn in templates that take them, so their breakpoint ends that turn."""
    marks = [(0, _ttl(t.cache_control)) for t in body.tools or [] if t.cache_control is not None]
    if isinstance(body.system, list):
        marks += [(0, _ttl(b.cache_control)) for b in body.system if b.cache_control is not None]
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):
            last = max((j for j, (index, _) in enumerate(origins) if index == i), default=None)
            if last is not None:
                marks += [(last, _ttl(b.cache_control)) for b in message.content if b.cache_control is not None]
    return marks + ([(len(origins) - 1, _ttl(body.cache_control))] if body.cache_control else [])


def anthropic_tools(body: AnthropicPrompt) -> list[dict] | None:
    if not body.tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                **({"description": tool.description} if tool.description is not None else {}),
                "parameters": tool.input_schema,
            },
        }
        for tool in body.tools
    ]


def anthropic_tool_choice(body: AnthropicPrompt) -> ToolChoice:
    choice = body.tool_choice
    if choice is None:
        return ToolChoice(AUTO)
    return {"auto": ToolChoice(AUTO), "none": ToolChoice(NONE), "any": ToolChoice(REQUIRED)}.get(
        choice.type, ToolChoice("function", choice.name)
    )


def anthropic_has_tool_history(body: AnthropicPrompt) -> bool:
    return any(
        isinstance(block, ToolUse | ToolResult)
        for message in body.messages
        if not isinstance(message.content, str)
        for block in message.content
    )
