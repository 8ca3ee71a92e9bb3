"""What the engine counts: its running totals, and the record of one finished request.

``EngineTotals`` is ``Engine.stats().totals``; ``to_dict`` gives
the JSON shape that the CLI, the server, the Prometheus export and a store's
persisted counters read (the same keys, in the same order, as before it was typed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from kvtier.tiers.counters import add_into

from .divergence import divergence
from .request import CANCELLED, ERROR, Request
from .text import without_broken_end

if TYPE_CHECKING:
    from .models.load import LoadedModel


@dataclass
class EngineTotals:
    """Requests .. sources, waited_tokens, wait_s: of finished requests; cancelled and
    errors: the others. store_seconds: time the step loop spent in the store (restore,
    publish), the offload overhead."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    store_seconds: float = 0.0
    l1_hit_loss_tokens: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # prompt tokens by where they came from
    cancelled: int = 0
    errors: int = 0
    waited_tokens: int = 0
    wait_s: float = 0.0

    def count(self, request: Request) -> None:
        """Add an ended request: a finished one in full, the others by how they ended."""
        if request.finish_reason == CANCELLED:
            self.cancelled += 1
        elif request.finish_reason == ERROR:
            self.errors += 1
        else:
            self.requests += 1
            self.prompt_tokens += len(request.prompt)
            self.generated_tokens += len(request.output)
            self.l1_hit_loss_tokens += request.l1_tokens_at_enqueue - request.l1_tokens_at_admission
            add_into(self.sources, request.sources())
            self.waited_tokens += request.waited_tokens
            self.wait_s += request.wait_s

    def snapshot(self) -> EngineTotals:
        """A copy that later counting does not change."""
        return replace(self, sources=dict(self.sources))

    def to_dict(self) -> dict:
        """The JSON shape (a copy: later counting does not change it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineTotals:
        """Totals a store persisted (``to_dict`` summed over processes): the numbers
        under known names, a damaged or unknown field left at its default."""
        known = {
            f.name: d[f.name]
            for f in fields(cls)
            if f.name != "sources" and isinstance(d.get(f.name), int | float) and not isinstance(d.get(f.name), bool)
        }
        raw = d.get("sources")
        sources = {str(k): int(v) for k, v in raw.items() if isinstance(v, int)} if isinstance(raw, Mapping) else {}
        return cls(**known, sources=sources)


def request_record(request: Request, loaded: LoadedModel, page_size: int) -> dict:
    """The JSON-ready record of a finished request (DESIGN §8)."""
    return {
        "id": request.rid,
        "prompt_tokens": len(request.prompt),
        "sources": request.sources(),
        "page_size": page_size,
        "model": loaded.name,
        "model_name": loaded.label,
        "output_token_ids": request.output,
        "text": without_broken_end(loaded.tokenizer.decode(request.output)),
        "finish_reason": request.finish_reason,
        "error": request.error,
        "plan": request.plan.to_dict() if request.plan else None,
        "divergence": divergence(request, loaded.tokenizer),
        "l1_tokens_at_enqueue": request.l1_tokens_at_enqueue,
        "l1_tokens_at_admission": request.l1_tokens_at_admission,
        "l1_hit_loss": request.l1_tokens_at_enqueue - request.l1_tokens_at_admission,
        "waited_tokens": request.waited_tokens,
        "wait_s": round(request.wait_s, 6),
        "ttft_s": None if request.t_first_token is None else round(request.t_first_token - request.t_submit, 6),
        "latency_s": None if request.t_done is None else round(request.t_done - request.t_submit, 6),
    }
