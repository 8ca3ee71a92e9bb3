"""The server's last requests, for the dashboard (``dashboard``, ``admin``): a bounded
ring of what each request was, kept when the server is done with it.

A record's ``strip`` is its prompt in order, run-length coded by source: the restored
pages by the tier each came from, then the shared start of an L1 page after them (L1),
then every other token (recomputed). So the tokens of each source in the strip add up
to that request's ``Request.sources()``, which is what its usage reported. A record
keeps copies (token ids, page keys, numbers), never the request, so the ring holds no
KV arrays. The ring has a fixed size: memory does not grow with traffic.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvtier.tiers.page import PageKey, Source

from ..request import Request

RING_SIZE = 64  # requests kept
LATENCY_SPAN_S = 60.0  # the latency percentiles cover the requests that ended this recently


@dataclass(frozen=True)
class RequestRecord:
    rid: int
    ended: float  # time.time() when the server was done with it
    prompt: tuple[int, ...]  # token ids: for the operator's view only, never in the public feed
    keys: tuple[PageKey, ...]  # its full pages (``admin`` pins them)
    output_tokens: int
    sources: dict[str, int]
    strip: tuple[tuple[str, int], ...]  # (source, tokens) runs in prompt order
    plan: dict | None  # RestorePlan.to_dict()
    ttft_s: float | None
    queue_s: float | None
    finish_reason: str | None

    @classmethod
    def of(cls, request: Request) -> RequestRecord:
        return cls(
            request.rid,
            time.time(),
            tuple(request.prompt),
            tuple(request.keys),
            len(request.output),
            request.sources(),
            tuple(strip_of(request)),
            request.plan.to_dict() if request.plan is not None else None,
            _since(request.t_first_token, request.t_submit),
            _since(request.t_admit, request.t_submit),
            request.finish_reason,
        )

    def to_json(self) -> dict:
        """What the public feed shows: no token ids, no text."""
        return {
            "rid": self.rid,
            "ended": self.ended,
            "prompt_tokens": len(self.prompt),
            "output_tokens": self.output_tokens,
            "sources": self.sources,
            "strip": [list(run) for run in self.strip],
            "plan": self.plan,
            "ttft_s": self.ttft_s,
            "queue_s": self.queue_s,
            "finish_reason": self.finish_reason,
        }


def strip_of(request: Request) -> list[tuple[str, int]]:
    """``request``'s prompt as (source, tokens) runs, in order (see the module's docstring)."""
    cells = [s.value for s in (request.restored.sources if request.restored else []) for _ in range(request.page_size)]
    cells += [Source.L1.value] * request.partial_tokens
    cells += [Source.RECOMPUTED.value] * (len(request.prompt) - len(cells))
    runs: list[tuple[str, int]] = []
    for cell in cells:
        if runs and runs[-1][0] == cell:
            runs[-1] = (cell, runs[-1][1] + 1)
        else:
            runs.append((cell, 1))
    return runs


class RecentRequests:
    """The last ``size`` requests, newest first; safe from any thread."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self._ring: deque[RequestRecord] = deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, request: Request) -> None:
        record = RequestRecord.of(request)
        with self._lock:
            self._ring.appendleft(record)

    def records(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._ring)

    def find(self, rid: int) -> RequestRecord | None:
        return next((r for r in self.records() if r.rid == rid), None)

    def latency(self, now: float, span_s: float = LATENCY_SPAN_S) -> dict[str, float | None]:
        """p50 and p95 of time to first token and time in the queue over the requests that
        ended in the last ``span_s`` seconds (None where there were none)."""
        recent = [r for r in self.records() if now - r.ended <= span_s]
        out: dict[str, float | None] = {"span_s": span_s, "requests": len(recent)}
        for name in ("ttft_s", "queue_s"):
            values = sorted(v for r in recent if (v := getattr(r, name)) is not None)
            stem = name.removesuffix("_s")
            out[f"{stem}_p50_s"] = _percentile(values, 50)
            out[f"{stem}_p95_s"] = _percentile(values, 95)
        return out


def _percentile(values: list[float], q: int) -> float | None:
    """The q-th percentile (inclusive method: within the values seen); None of nothing."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _since(t: float | None, start: float) -> float | None:
    return None if t is None else t - start
