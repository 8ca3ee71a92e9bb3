"""Tool calls on ``kvtier serve`` (DESIGN §8a), on mlx-lm's model side: the tokenizer's
tool-call markers and parser (``TokenizerWrapper.tool_call_start`` / ``tool_call_end`` /
``tool_parser``, chosen by mlx-lm from the chat template) and its ``TextStateMachine``.

In: the request's tools reach the prompt through the chat template, and ``tool_choice``
becomes constrained decoding (``SamplingParams.forced`` / ``banned``): ``none`` bans the
start marker, ``required`` forces it, a named function forces the template's own text
of a call up to that name. The prompt is the same whatever the choice, so the choice
never costs a cache miss.

Out: generated text is split at the markers; each call's text goes through the
tokenizer's parser. A call that does not parse is handed back as the text it was
(markers included), with a warning in the log: never an error.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import TextStateMachine

from .api import invalid

log = logging.getLogger(__name__)

AUTO, NONE, REQUIRED = "auto", "none", "required"


@dataclass(frozen=True)
class ToolChoice:
    """What a request allows: ``auto``, ``none``, ``required``, or a call of ``name``."""

    mode: str = AUTO
    name: str | None = None


@dataclass
class ToolCall:
    """One parsed call: the function's name, its arguments as the parser read them (key
    order kept), and an id in the API's style."""

    name: str
    arguments: Any
    id: str

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json()}}
        return call if index is None else {"index": index, **call}

    def anthropic(self, with_input: bool = True) -> dict:
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": self.arguments if with_input else {}}


def check_tools(tokenizer, tools: list[dict] | None, history_has_tools: bool, param: str) -> None:
    """A 400 naming the reason where the model's chat template cannot take tools: the
    tools would never reach the prompt, nor a call be read back."""
    if (tools or history_has_tools) and not tokenizer.has_tool_calling:
        what = "tools" if tools else "tool calls in the messages"
        raise invalid(
            f"{param}: this model's chat template has no tool calling (mlx-lm finds no tool-call "
            f"format in it), so {what} cannot reach the prompt; serve a model whose template renders tools",
            param,
        )


def constraints(
    tokenizer, choice: ToolChoice, tools: list[dict] | None, call_text: str | None
) -> tuple[list[int], list[list[int]]]:
    """The ``forced`` and ``banned`` tokens for a tool choice. ``call_text`` is the
    template's text of a call of ``choice.name`` after the generation prompt (named only)."""
    if choice.mode != AUTO and choice.mode != NONE and not tools:
        raise invalid("tool_choice: asks for a tool call, but the request has no tools", "tool_choice")
    if not tools or choice.mode == AUTO:
        return [], []
    start = list(tokenizer.tool_call_start_tokens)
    if choice.mode == NONE:
        return [], [start]
    if choice.mode == REQUIRED:
        return start, []
    if choice.name not in {tool["function"]["name"] for tool in tools}:
        raise invalid(f"tool_choice: names {choice.name!r}, which is not among the tools", "tool_choice")
    name, text = choice.name or "", call_text or ""
    begin = text.find(tokenizer.tool_call_start)
    at = text.find(name, begin) if begin >= 0 else -1
    if at < 0:
        raise invalid("tool_choice: this model's chat template does not show how a named call begins", "tool_choice")
    return list(tokenizer.encode(text[: at + len(name)], add_special_tokens=False)), []


def named_call_message(name: str) -> dict:
    """An assistant message calling ``name``, to render a call's text with the template."""
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": {}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


class ToolCallText:
    """Generated text split into plain text and tool calls, as it arrives.

    mlx-lm's ``TextStateMachine`` on the tokenizer's markers holds back text that may
    begin a marker and strips the markers; the text between them is one call's, parsed
    when its end marker arrives (or when generation ends inside it).
    """

    def __init__(self, tokenizer, tools: list[dict] | None, id_prefix: str) -> None:
        self._parser = tokenizer.tool_parser
        self._tools = tools
        self._start, self._end = tokenizer.tool_call_start, tokenizer.tool_call_end
        edges = {"normal": [(self._start, "tool")], "tool": [(self._end, "normal")] if self._end else []}
        self._state = TextStateMachine(edges).make_state("normal")
        self._call = ""  # text of the call being generated
        self._in_call = False
        self._id_prefix = id_prefix
        self.calls: list[ToolCall] = []

    def add(self, text: str) -> tuple[str, list[ToolCall]]:
        """Text that is now safe to hand out, and the calls that were completed."""
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._take(segments)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Generation ended: the text held back, and a call that was still open."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        out, calls = self._take([(state, rest)])
        if self._in_call:
            self._in_call = False
            text, call = self._parsed(self._call, closed=False)
            out, calls = out + text, calls + call
        return out, calls

    def _take(self, segments: list[tuple[str, str]]) -> tuple[str, list[ToolCall]]:
        out, calls = "", list[ToolCall]()
        for state, text in segments:
            if state == "tool":
                self._in_call = True
                self._call += text
                continue
            if self._in_call:  # the end marker came: the call is complete
                self._in_call = False
                failed, call = self._parsed(self._call, closed=True)
                out, calls = out + failed, calls + call
            out += text
        return out, calls

    def _parsed(self, text: str, closed: bool) -> tuple[str, list[ToolCall]]:
        self._call = ""
        try:
            parsed = self._parser(text, self._tools)
            found = parsed if isinstance(parsed, list) else [parsed]
            calls = [ToolCall(p["name"], p["arguments"], f"{self._id_prefix}{uuid.uuid4().hex[:24]}") for p in found]
        except Exception as err:  # parsers raise many kinds (ValueError, KeyError, TypeError, ...)
            log.warning("a generated tool call does not parse (%s: %s); returned as text", type(err).__name__, err)
            return self._start + text + (self._end if closed else ""), []
        self.calls += calls
        return "", calls
