"""What ``kvtier serve`` answers (DESIGN §8a): usage objects, responses, SSE chunks and
Anthropic events, from a request's outcome, a :class:`Finished`.

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
from typing import Any

from .api import APIError

RESTORED = ("L1", "L2", "L3")


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
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stop_string: str | None  # the stop string that ended it, if one did
    prompt: PromptUsage
    logprobs: list[TokenChoice] | None = None  # when the request asked for them


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
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": done.text},
                "finish_reason": done.finish_reason,
                "logprobs": logprobs,
            }
            return self._envelope("chat.completion", [choice], usage=usage(done))
        choice = {"index": 0, "text": done.text, "finish_reason": done.finish_reason, "logprobs": logprobs}
        return self._envelope("text_completion", [choice], usage=usage(done))

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: list[TokenChoice] | None = None,
    ) -> str:
        """One chunk; ``logprobs`` are those of the tokens whose text it brings."""
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
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
        return self._message(
            [{"type": "text", "text": done.text}],
            _stop_reason(done),
            done.stop_string,
            anthropic_usage(done.prompt, done.completion_tokens),
        )

    def start_events(self, prompt: PromptUsage) -> list[str]:
        """``message_start`` (with the prompt's cache split) and the text block's start."""
        message = self._message([], None, None, anthropic_usage(prompt, 0))
        return [
            sse({"type": "message_start", "message": message}, "message_start"),
            sse(
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                "content_block_start",
            ),
        ]

    @staticmethod
    def delta_event(text: str) -> str:
        return sse(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
            "content_block_delta",
        )

    def final_events(self, done: Finished) -> list[str]:
        delta = {"stop_reason": _stop_reason(done), "stop_sequence": done.stop_string}
        return [
            sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            sse(
                {
                    "type": "message_delta",
                    "delta": delta,
                    "usage": anthropic_usage(done.prompt, done.completion_tokens),
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
