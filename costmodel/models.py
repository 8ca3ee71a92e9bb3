"""Fitted time models: one per link, one for the model's prefill (DESIGN §6).

- Link: ``T(D) = setup_s + D / bytes_per_s`` for ``D`` bytes moved in one restore.
- Compute: ``T(n, p) = c0 + c1*n + c2*n*(p + n/2)`` for ``n`` new tokens after
  ``p`` cached ones (attention work grows with the context).

Both are least-squares fits of relative error over a window of recent samples
(calibration first, then every real transfer and prefill), refitted on each new
sample after dropping outliers (residual above 3 median absolute residuals), so one
slow step caused by the machine does not move the model. Coefficients are clamped
non-negative.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

WINDOW = 64


def robust_fit(features: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Non-negative least-squares-ish coefficients, refitted once without outliers."""
    coef = _clamped_lstsq(features, times)
    residual = np.abs(features @ coef - times)
    mad = np.median(residual)
    keep = residual <= 3 * mad + 1e-12
    if 0 < keep.sum() < len(times) and keep.sum() >= features.shape[1]:
        coef = _clamped_lstsq(features[keep], times[keep])
    return coef


def _clamped_lstsq(features: np.ndarray, times: np.ndarray) -> np.ndarray:
    coef = np.linalg.lstsq(features, times, rcond=None)[0]
    while (coef < 0).any():  # drop negative terms and refit the rest
        active = coef > 0
        coef = np.zeros_like(coef)
        if active.any():
            coef[active] = np.linalg.lstsq(features[:, active], times, rcond=None)[0]
    return coef


@dataclass
class ErrorLog:
    """Relative prediction errors ``|predicted - measured| / measured``, recent first."""

    errors: deque = field(default_factory=lambda: deque(maxlen=256))

    def record(self, predicted: float, measured: float) -> None:
        if measured > 0:
            self.errors.append(abs(predicted - measured) / measured)

    def summary(self) -> dict:
        if not self.errors:
            return {"count": 0}
        values = np.array(self.errors)
        return {"count": len(values), "median": float(np.median(values)),
                "p90": float(np.percentile(values, 90))}


@dataclass
class TimeModel:
    """``seconds = coef . features(x)``, refitted on a window of recent samples."""

    coef: list[float]
    samples: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    error: ErrorLog = field(default_factory=ErrorLog)

    @staticmethod
    def features(*x: float) -> list[float]:
        raise NotImplementedError

    def predict(self, *x: float) -> float:
        return max(float(np.dot(self.coef, self.features(*x))), 0.0)

    def observe(self, *x: float, seconds: float) -> None:
        """Record a real measurement: log the prediction error, then refit."""
        self.error.record(self.predict(*x), seconds)
        self.samples.append((*x, seconds))
        self.refit()

    def refit(self) -> None:
        if len({s[:-1] for s in self.samples}) < 2 * len(self.coef):
            return  # too few distinct inputs to separate the terms reliably
        data = np.array(self.samples, dtype=float)
        features = np.array([self.features(*row[:-1]) for row in data])
        # Each row divided by its time: the fit minimises relative errors, so a 3 MiB
        # restore counts as much as a 300 MiB one (predictions are judged relatively).
        weight = 1.0 / np.maximum(data[:, -1], 1e-9)
        self.coef = [float(c) for c in robust_fit(features * weight[:, None], data[:, -1] * weight)]

    def to_dict(self) -> dict:
        return {"coef": self.coef, "samples": [list(s) for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict) -> TimeModel:
        model = cls(list(d["coef"]))
        model.samples.extend(tuple(s) for s in d.get("samples", []))
        return model


class LinkModel(TimeModel):
    """Time to move ``D`` bytes over one link in one restore: ``setup_s + D / bytes_per_s``."""

    @staticmethod
    def features(nbytes: float) -> list[float]:
        return [1.0 if nbytes else 0.0, nbytes]

    @classmethod
    def of(cls, setup_s: float, bytes_per_s: float) -> LinkModel:
        return cls([setup_s, 1.0 / bytes_per_s])

    @property
    def setup_s(self) -> float:
        return self.coef[0]

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / self.coef[1] if self.coef[1] > 0 else float("inf")


class ComputeModel(TimeModel):
    """Prefill time of ``n`` new tokens after ``p`` cached: ``c0 + c1*n + c2*n*(p + n/2)``."""

    @staticmethod
    def features(n: float, p: float) -> list[float]:
        return [1.0 if n > 0 else 0.0, n, n * (p + n / 2)]
