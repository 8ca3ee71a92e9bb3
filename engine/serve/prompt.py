"""A chat request's prompt: messages and tools through the model's chat template, and
the constraints its ``tool_choice`` puts on the answer (``tools``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ..limits import InputError, TextLimit
from . import render as bodies
from . import tools as tool_calls
from .api import AnthropicPrompt, ChatCompletionRequest, invalid
from .tools import ToolChoice


@dataclass
class Prompt:
    tokens: list[int]
    tools: list[dict] | None = None  # as the template took them; the parser gets them too
    forced: list[int] = field(default_factory=list)  # SamplingParams.forced
    banned: list[list[int]] = field(default_factory=list)  # SamplingParams.banned
    messages: list[dict] = field(default_factory=list)  # as the template took them
    origins: list[tuple[int | None, str]] = field(default_factory=list)  # per message: the request's index, role
    breakpoints: list[tuple[int, float]] = field(default_factory=list)  # cache_control: (tokens up to it, TTL s)

    @property
    def cached_prefix(self) -> int:
        """Tokens up to the last cache_control breakpoint (0: none)."""
        return max((tokens for tokens, _ in self.breakpoints), default=0)

    def message_at(self, tokenizer, token: int) -> tuple[int | None, str | None]:
        """The request's message (index, role) that holds prompt token ``token``: the first
        whose rendered prefix of the conversation reaches past it (a binary search over
        renderings of the first k messages, as text). (None, None) for a plain prompt."""
        if not self.messages:
            return None, None
        at = len(tokenizer.decode(self.tokens[:token]))
        low, high = 0, len(self.messages) - 1
        while low < high:  # the smallest k whose first k + 1 messages render past ``at``
            mid = (low + high) // 2
            if len(_text(tokenizer, self.messages[: mid + 1], self.tools)) > at:
                high = mid
            else:
                low = mid + 1
        return self.origins[low]

    @property
    def tools_digest(self) -> str:
        """What identifies the tools as the template took them ("" without tools): two
        requests whose tools differ in any byte (order included) differ here."""
        if not self.tools:
            return ""
        return hashlib.blake2b(json.dumps(self.tools).encode(), digest_size=16).hexdigest()

    @property
    def reads_calls(self) -> bool:
        """Whether the answer is read for tool calls (a request without tools gets text)."""
        return bool(self.tools) and not self.banned


def render(
    tokenizer,
    messages: list[dict],
    origins: list[tuple[int | None, str]],
    tools: list[dict] | None,
    choice: ToolChoice,
    tool_history: bool,
    marks: list[tuple[int, float]],
    limit: TextLimit | None = None,
) -> Prompt:
    """The prompt, or a 400: a template that cannot take tools (or render these messages),
    or messages whose text alone is more than ``limit`` lets the context hold (checked
    before anything is rendered). ``marks`` are the cache_control breakpoints as (the
    template message they end, TTL)."""
    text = sum(len(m["content"].encode()) for m in messages if isinstance(m.get("content"), str))
    check_text(limit, text, "messages")
    tool_calls.check_tools(tokenizer, tools, tool_history, "tools" if tools else "messages")
    tokens = list(_apply(tokenizer, messages, tools, True))
    call_text = None
    if choice.name is not None and tools:
        # The template's own text of a call, after the generation prompt: what the answer starts with.
        before = _apply(tokenizer, messages, tools, True, tokenize=False)
        after = _apply(tokenizer, [*messages, tool_calls.named_call_message(choice.name)], tools, False, tokenize=False)
        call_text = after[len(before) :] if after.startswith(before) else None
    forced, banned = tool_calls.constraints(tokenizer, choice, tools, call_text)
    breakpoints = [(min(len(tokens), _length(tokenizer, messages[: j + 1], tools)), ttl) for j, ttl in marks]
    return Prompt(tokens, tools, forced, banned, messages, origins, breakpoints)


def chat_prompt(tokenizer, body: ChatCompletionRequest, limit: TextLimit | None = None) -> Prompt:
    """A chat completion's prompt: the one rendering ``kvtier serve`` submits and
    ``kvtier route`` keys its placement by (the same tokens, so the same page keys)."""
    return render(
        tokenizer,
        bodies.chat_messages(body),
        bodies.chat_origins(body),
        bodies.chat_tools(body),
        bodies.chat_tool_choice(body),
        bodies.chat_has_tool_history(body),
        bodies.chat_breakpoints(body),
        limit,
    )


def anthropic_prompt(tokenizer, body: AnthropicPrompt, limit: TextLimit | None = None) -> Prompt:
    """An Anthropic request's prompt (messages and count_tokens alike), as :func:`chat_prompt`."""
    messages, origins = bodies.anthropic_messages(body)
    return render(
        tokenizer,
        messages,
        origins,
        bodies.anthropic_tools(body),
        bodies.anthropic_tool_choice(body),
        bodies.anthropic_has_tool_history(body),
        bodies.anthropic_breakpoints(body, origins),
        limit,
    )


def check_text(limit: TextLimit | None, text_bytes: int, param: str) -> None:
    """A 400 for text of ``text_bytes`` bytes that cannot fit in the context (``TextLimit``)."""
    if limit is None:
        return
    try:
        limit.check(text_bytes)
    except InputError as err:
        raise invalid(str(err), param) from None


def _length(tokenizer, messages: list[dict], tools: list[dict] | None) -> int:
    """Tokens of the first messages' rendering (the prompt's start, up to their end)."""
    return len(tokenizer.encode(_text(tokenizer, messages, tools), add_special_tokens=False))


def _text(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False, tokenize=False)
    except Exception:  # a template may refuse a conversation cut short (e.g. no user turn yet)
        return ""


def _apply(tokenizer, messages: list[dict], tools: list[dict] | None, generation: bool, tokenize: bool = True):
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=tokenize)
    except Exception as err:  # jinja and template errors come in many types
        raise invalid(f"the chat template cannot render these messages: {err}", "messages") from None
