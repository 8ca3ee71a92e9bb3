"""What ``Engine.stats()`` returns, typed: the engine's totals, the cached-token window,
the cost model's summary and the store's counters (``tiers.stats.StoreStats``), taken
at one moment.

``to_json`` is the one place its JSON shape is made: ``kvtier run --json``'s
``counters``, ``/v1/kvtier/stats`` and the Prometheus export read it, with the keys
and order they have always had (``engine``, ``windowed``, ``costmodel``, then the
store's ``tiers``, ``links``, ``l3``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.tiers.stats import StoreStats

from .totals import EngineTotals


@dataclass(frozen=True)
class Window:
    """Restored prompt tokens per second over the last ``window_s`` seconds."""

    window_s: float
    cached_tokens_per_s: float


@dataclass(frozen=True)
class EngineStats:
    """``totals`` is a copy (later counting does not change it); ``costmodel`` is
    ``Profile.summary()``, the cost model's own JSON; ``store`` None: no store."""

    totals: EngineTotals
    windowed: Window
    costmodel: Mapping[str, Any]
    store: StoreStats | None = None

    def to_json(self) -> dict:
        shape = {"engine": self.totals.to_dict(), "windowed": asdict(self.windowed), "costmodel": self.costmodel}
        if self.store is not None:
            shape.update(self.store.to_json())
        return shape
