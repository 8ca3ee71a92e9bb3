"""What ``kvtier run`` prints: each request's text as it is generated, then the tables."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..text import OutputText
from .report import format_tier_table

if TYPE_CHECKING:
    from ..stats import EngineStats

# A Ctrl-C can land after the engine took a request from its queue and before it ran
# it: that request is never ended and its stream never closes, so after an interrupt
# the printer is given this long, not waited for.
PRINTER_GRACE_S = 2.0


class Printer:
    """Prints each request's text as its tokens are generated, requests in order.

    Runs on its own thread reading ``Request.stream()`` while the main thread runs the
    engine's step loop (so Ctrl-C lands in the step loop, which then closes the store).
    """

    def __init__(self, tokenizer, result: Callable) -> None:
        self.tokenizer, self.result = tokenizer, result
        self.requests: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._print_all, name="kvtier-printer", daemon=True)
        self.thread.start()

    def add(self, request) -> None:
        self.requests.put(request)

    def finish(self, timeout: float | None = None) -> None:
        self.requests.put(None)
        self.thread.join(timeout)

    def _print_all(self) -> None:
        while (request := self.requests.get()) is not None:
            print(f"── request {request.rid}: {len(request.prompt)} prompt tokens", flush=True)
            text = OutputText(self.tokenizer.detokenizer, [])  # whole characters only
            for token in request.stream():
                print(text.add(token), end="", flush=True)
            tail = text.finish()
            r = self.result(request)
            print(tail)
            ttft = (
                f"{r['finish_reason']} before the first token"
                if r["ttft_s"] is None
                else f"ttft {r['ttft_s'] * 1000:.0f} ms"
            )
            print(
                f"   {ttft}, {len(r['output_token_ids'])} tokens out; sources: "
                + "  ".join(f"{k}={v}" for k, v in r["sources"].items()),
                flush=True,
            )


def print_summary(stats: EngineStats) -> None:
    print()
    print(format_tier_table(stats.store))
    if stats.costmodel is not None and not stats.costmodel.calibrated:
        print("\ncost model: defaults (run `kvtier calibrate` to measure this machine)")
