"""What the engine reports, typed: its totals, the cached-token window, the cost
model's fit (``costmodel.summary.ProfileSummary``) and the store's counters
(``tiers.stats.StoreStats``), taken at one moment (``Engine.stats()``), or read back
from what a store persisted (``EngineStats.persisted``, ``kvtier stats``).

``to_json`` is the one place its JSON shape is made: ``kvtier run --json``'s
``counters``, ``/v1/kvtier/stats`` and ``kvtier stats --json`` read it, with the keys
and order they have always had (``engine``, ``windowed``, ``costmodel``, then the
store's ``tiers``, ``links``, ``l3``); the Prometheus export and the text tables read
the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.costmodel.summary import ProfileSummary
from kvtier.tiers.counters import TierStats
from kvtier.tiers.stats import L3Place, StoreStats

from .totals import EngineTotals


@dataclass(frozen=True)
class Window:
    """Restored prompt tokens per second over the last ``window_s`` seconds."""

    window_s: float
    cached_tokens_per_s: float

    @classmethod
    def from_json(cls, d: Any) -> Window | None:
        try:
            return cls(float(d["window_s"]), float(d["cached_tokens_per_s"]))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class LastRun:
    """What the last engine on a store saw when it closed: its model, its window and
    its cost model's fit (``kvtier stats`` prints it)."""

    model: str
    windowed: Window | None
    costmodel: ProfileSummary

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "windowed": asdict(self.windowed) if self.windowed else {},
            "costmodel": self.costmodel.to_json(),
        }

    @classmethod
    def from_json(cls, d: Any) -> LastRun | None:
        """The record a store keeps; None when there is none (or it is not one)."""
        if not isinstance(d, Mapping) or not d:
            return None
        return cls(
            str(d.get("model")), Window.from_json(d.get("windowed")), ProfileSummary.from_json(d.get("costmodel"))
        )


@dataclass(frozen=True)
class EngineStats:
    """``totals`` is a copy (later counting does not change it); ``store`` None: no
    store. Read back from a store's persisted counters there is no window and no cost
    model (None), and ``last_run`` may say what the last engine on it saw."""

    totals: EngineTotals | None
    windowed: Window | None
    costmodel: ProfileSummary | None
    store: StoreStats | None = None
    last_run: LastRun | None = None

    @classmethod
    def persisted(cls, counters: Any, last_run: Any, l3: L3Place, l3_now: TierStats) -> EngineStats:
        """The counters every process on a store added up (``TieredStore.close``'s
        ``cumulative``, with the engine's totals under ``engine``), its L3 as it is now,
        and its ``last_run`` record."""
        engine = counters.get("engine") if isinstance(counters, Mapping) else None
        totals = EngineTotals.from_dict(engine) if isinstance(engine, Mapping) else None
        store = StoreStats.from_cumulative(counters, l3, l3_now)
        return cls(totals, None, None, store, LastRun.from_json(last_run))

    def to_json(self) -> dict:
        shape: dict[str, Any] = {}
        if self.totals is not None:
            shape["engine"] = self.totals.to_dict()
        if self.windowed is not None:
            shape["windowed"] = asdict(self.windowed)
        if self.costmodel is not None:
            shape["costmodel"] = self.costmodel.to_json()
        if self.store is not None:
            shape.update(self.store.to_json())
        if self.last_run is not None:
            shape["last_run"] = self.last_run.to_json()
        return shape
