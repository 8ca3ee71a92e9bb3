"""A chat request's prompt: messages and tools through the model's chat template, and
the constraints its ``tool_choice`` puts on the answer (``tools``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import tools as tool_calls
from .api import invalid
from .tools import ToolChoice


@dataclass
class Prompt:
    tokens: list[int]
    tools: list[dict] | None = None  # as the template took them; the parser gets them too
    forced: list[int] = field(default_factory=list)  # SamplingParams.forced
    banned: list[list[int]] = field(default_factory=list)  # SamplingParams.banned

    @property
    def reads_calls(self) -> bool:
        """Whether the answer is read for tool calls (a request without tools gets text)."""
        return bool(self.tools) and not self.banned


def render(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    choice: ToolChoice,
    tool_history: bool,
) -> Prompt:
    """The prompt, or a 400: a template that cannot take tools (or render these messages)."""
    tool_calls.check_tools(tokenizer, tools, tool_history, "tools" if tools else "messages")
    tokens = list(_apply(tokenizer, messages, tools, True))
    call_text = None
    if choice.name is not None and tools:
        # The template's own text of a call, after the generation prompt: what the answer starts with.
        before = _apply(tokenizer, messages, tools, True, tokenize=False)
        after = _apply(tokenizer, [*messages, tool_calls.named_call_message(choice.name)], tools, False, tokenize=False)
        call_text = after[len(before) :] if after.startswith(before) else None
    forced, banned = tool_calls.constraints(tokenizer, choice, tools, call_text)
    return Prompt(tokens, tools, forced, banned)


def _apply(tokenizer, messages: list[dict], tools: list[dict] | None, generation: bool, tokenize: bool = True):
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=tokenize)
    except Exception as err:  # jinja and template errors come in many types
        raise invalid(f"the chat template cannot render these messages: {err}", "messages") from None
