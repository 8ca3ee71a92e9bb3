"""The turns the server answered lately, to say when a request recomputes what an earlier
turn of its conversation had (DESIGN §8a): one INFO line naming where its prompt left
the cache, and whether the tokens there changed (prefix drift) or were evicted.

A request's conversation is the turn it names (Anthropic's
``diagnostics.previous_message_id``), else the latest turn under its key (OpenAI's
``prompt_cache_key`` or ``user``, Anthropic's ``metadata.user_id``, which Claude Code
sets per session), else the remembered turn that shares the longest prefix with it, of
at least a page. Only the last ``keep`` turns are remembered (their token ids, no text).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Turn:
    id: str  # the response's id
    key: str | None  # the conversation key it was sent with
    tokens: np.ndarray  # its prompt and answer
    scope: bytes = b""  # its caller's root (DESIGN §9a): only the same caller's requests compare with it
    tools: str = ""  # its tools' digest (``Prompt.tools_digest``)


@dataclass(frozen=True)
class Loss:
    """What a request recomputed of an earlier turn: ``tokens`` past its stored match that
    the turn had, and where the two prompts part (``common``: their shared prefix)."""

    previous: Turn
    tokens: int
    common: int


class Conversations:
    def __init__(self, page_size: int, keep: int = 256) -> None:
        self.page_size, self.keep = page_size, keep
        self._turns: OrderedDict[str, Turn] = OrderedDict()
        self._lock = threading.Lock()  # requests end on the event loop and in worker threads

    def remember(self, turn_id: str, key: str | None, tokens: list[int], scope: bytes = b"", tools: str = "") -> None:
        with self._lock:
            self._turns[turn_id] = Turn(turn_id, key, np.asarray(tokens, np.int64), scope, tools)
            while len(self._turns) > self.keep:
                self._turns.popitem(last=False)

    def known(self, turn_id: str | None, scope: bytes = b"") -> bool:
        """Whether ``turn_id`` is a remembered turn of ``scope``'s (None: none was named, so yes)."""
        with self._lock:
            return turn_id is None or (turn_id in self._turns and self._turns[turn_id].scope == scope)

    def loss(
        self, prompt: list[int], matched: int, key: str | None, previous_id: str | None, scope: bytes = b""
    ) -> Loss | None:
        """What ``prompt``, whose stored match ended at ``matched``, recomputes of its
        conversation's previous turn, if more than a page (else None). Only turns of the
        same ``scope`` (caller) count: another tenant's are never compared with."""
        tokens = np.asarray(prompt, np.int64)
        with self._lock:
            previous = self._previous(tokens, key, previous_id, scope)
        if previous is None:
            return None
        lost = min(len(previous.tokens), len(prompt) - 1) - matched
        if lost <= self.page_size:
            return None
        return Loss(previous, lost, _common(previous.tokens, tokens))

    def _previous(self, tokens: np.ndarray, key: str | None, previous_id: str | None, scope: bytes) -> Turn | None:
        turns = [t for t in self._turns.values() if t.scope == scope]
        if previous_id is not None:
            return next((t for t in turns if t.id == previous_id), None)
        if key is not None:
            return next((t for t in reversed(turns) if t.key == key), None)
        best, longest = None, self.page_size - 1
        for turn in reversed(turns):
            if (common := _common(turn.tokens, tokens)) > longest:
                best, longest = turn, common
        return best


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def miss_reason(loss: Loss | None, known: bool, report: dict, tools: str = "") -> dict | None:
    """Anthropic's ``cache_miss_reason`` (None: no miss): ``tools_changed`` when the tools
    differ from the previous turn's (``tools``: this request's digest; tools come first in
    Anthropic's cache order, and a template renders them inside the system turn, so the
    divergence's role cannot tell), else where the prompt changed, by the role holding
    the divergence; pages evicted though unchanged are ``unavailable`` (the request
    changed nothing; ``usage.kvtier`` says more)."""
    if not known:
        return {"type": "previous_message_not_found"}
    if loss is None:
        return None
    if loss.common > report["token"]:
        return {"type": "unavailable"}
    if loss.previous.tools != tools:
        kind = "tools_changed"
    else:
        kind = "system_changed" if report["role"] == "system" else "messages_changed"
    return {"type": kind, "cache_missed_input_tokens": loss.tokens}


def log_loss(request_id: str, loss: Loss, report: dict) -> None:
    """The INFO line: where the prompt left the cache and why (changed tokens or eviction)."""
    at = report["token"]
    why = (
        f"the tokens there are the previous turn's (evicted: {loss.common - at} tokens more were the same)"
        if loss.common > at
        else "the prompt differs from the previous turn's there"
    )
    role = report.get("role")
    where = {None: "the prompt", "system": "the system prompt"}.get(role, f"message {report.get('message')} ({role})")
    log.info(
        "%s recomputes %d tokens that %s of its conversation had: its prompt left the cache at token %d of %d, "
        "in %s, between %r and %r; %s",
        request_id,
        loss.tokens,
        loss.previous.id,
        at,
        report["prompt_tokens"],
        where,
        report["before"],
        report["after"],
        why,
    )
