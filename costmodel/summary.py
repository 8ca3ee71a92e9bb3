"""The cost model's fit as stats report it, typed: per link its setup time, bandwidth
and prediction errors, and the prefill model's coefficients and errors.

``to_json`` is the one place its JSON shape is made (``costmodel`` in ``kvtier run
--json``, ``/v1/kvtier/stats``, a store's ``last_run``); ``from_json`` reads that shape
back (a store's ``last_run``, written by another process), taking what it can use and
leaving out what it cannot, so a damaged or older record never stops a report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _number(value: Any, default: float = 0.0) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


@dataclass(frozen=True)
class ErrorSummary:
    """Relative prediction errors: how many were checked, their median and 90th
    percentile (both 0 while none was)."""

    count: int = 0
    median: float = 0.0
    p90: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {"count": self.count, "median": self.median, "p90": self.p90} if self.count else {"count": 0}

    @classmethod
    def from_json(cls, d: Any) -> ErrorSummary:
        d = _mapping(d)
        return cls(int(_number(d.get("count"))), _number(d.get("median")), _number(d.get("p90")))


@dataclass(frozen=True)
class LinkFit:
    """A link's fit, and how many measured transfers it rests on (``samples``: a fit
    that rejected them, as ``LinkModel.repaired`` may, still counts them)."""

    setup_s: float
    gib_s: float
    error: ErrorSummary
    samples: int = 0

    def to_json(self) -> dict:
        return {"setup_s": self.setup_s, "gib_s": self.gib_s, "error": self.error.to_json(), "samples": self.samples}


@dataclass(frozen=True)
class ComputeFit:
    """Prefill seconds of n new tokens after p cached ones: ``c0 + c1*n + c2*n*(p + n/2)``."""

    c0: float
    c1: float
    c2: float
    error: ErrorSummary

    def to_json(self) -> dict:
        return {"c0": self.c0, "c1": self.c1, "c2": self.c2, "error": self.error.to_json()}


@dataclass(frozen=True)
class ProfileSummary:
    """``compute`` None: a record that had none (read back from an older store)."""

    calibrated: bool
    links: Mapping[str, LinkFit]
    compute: ComputeFit | None

    def to_json(self) -> dict:
        shape: dict[str, Any] = {"calibrated": self.calibrated}
        shape["links"] = {name: fit.to_json() for name, fit in self.links.items()}
        if self.compute is not None:
            shape["compute"] = self.compute.to_json()
        return shape

    @classmethod
    def from_json(cls, d: Any) -> ProfileSummary:
        d = _mapping(d)
        links = {
            str(name): LinkFit(
                _number(m.get("setup_s")),
                _number(m.get("gib_s")),
                ErrorSummary.from_json(m.get("error")),
                int(_number(m.get("samples"))),
            )
            for name, m in _mapping(d.get("links")).items()
            if isinstance(m, Mapping)
        }
        c = d.get("compute")
        compute = None
        if isinstance(c, Mapping):
            c0, c1, c2 = (_number(c.get(k)) for k in ("c0", "c1", "c2"))
            compute = ComputeFit(c0, c1, c2, ErrorSummary.from_json(c.get("error")))
        return cls(bool(d.get("calibrated")), links, compute)
