"""Fitted time models: one per link, one for the model's prefill (DESIGN §6).

- Link: ``T(D) = setup_s + D / bytes_per_s`` for ``D`` bytes moved in one restore.
- Compute: ``T(n, p) = c0 + c1*n + c2*n*(p + n/2)`` for ``n`` new tokens after
  ``p`` cached ones (attention work grows with the context).

Both are fitted over a window of recent samples (calibration first, then every real
transfer and prefill), refitted on each new sample (the engine defers that refit while
a request waits for its first token: ``engine.refinement``), with non-negative coefficients and
robust to outliers (``robust_fit``), so one step the machine stalled, or one timing far
too short, does not move the model. A fit whose figures no machine can have (a link
faster than device memory, or infinitely fast: samples that do not grow with the bytes;
a NaN; a free prefill) is not adopted: the model keeps its previous coefficients (the
defaults, before any fit), so neither planning nor ``kvtier stats`` ever sees it.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar, TypeVar

import numpy as np
from scipy.optimize import least_squares, nnls

from .summary import ErrorSummary

log = logging.getLogger(__name__)

WINDOW = 64
MAX_BYTES_PER_S = float(1 << 44)  # 16 TiB/s: above any device memory's bandwidth (a few TB/s)
MAX_SETUP_S = 10.0  # a restore's fixed cost; more is a stalled sample, not a link
MIN_TOKEN_S = 1e-8  # prefill of one token: ~2 FLOP per parameter; 10 ns is no model on any device
OUTLIER = 2.0  # a sample predicted more than 2x too fast or too slow triggers the robust refit
_TINY = 1e-300


def robust_fit(features: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Non-negative coefficients ``c`` with ``features @ c`` close to ``times`` in relative
    terms, robust to outliers.

    First scipy's NNLS on each row divided by its time (relative errors). When every
    sample lies within ``OUTLIER`` of that fit, it is the answer: the common case, in
    microseconds. Otherwise scipy's ``least_squares`` refits ``log(predicted / measured)``
    from there, bounded non-negative, with a soft-L1 loss of scale 0.02 (close to least
    absolute errors, a convex loss: no start leads it astray): log, because a relative
    error is bounded for a sample too slow but not for one too fast, which would pull
    the whole fit. That refit takes milliseconds, too slow to run on every sample.
    """
    scale = np.linalg.norm(features, axis=0)
    scale[scale == 0] = 1.0  # columns scaled to one: bytes and seconds differ by 1e9
    scaled = features / scale
    coef = nnls(scaled / times[:, None], np.ones_like(times))[0]
    predicted = scaled @ coef
    if np.all(np.abs(np.log(np.maximum(predicted, _TINY) / times)) <= np.log(OUTLIER)):
        return coef / scale
    log_times = np.log(times)
    fit = least_squares(
        lambda c: np.log(np.maximum(scaled @ c, _TINY)) - log_times,
        coef,
        jac=lambda c: scaled / np.maximum(scaled @ c, _TINY)[:, None],
        bounds=(0.0, np.inf),
        loss="soft_l1",
        f_scale=0.02,
    )
    return fit.x / scale


@dataclass
class ErrorLog:
    """Relative prediction errors ``|predicted - measured| / measured``, recent first."""

    errors: deque = field(default_factory=lambda: deque(maxlen=256))

    def record(self, predicted: float, measured: float) -> None:
        if measured > 0:
            self.errors.append(abs(predicted - measured) / measured)

    def summary(self) -> ErrorSummary:
        if not self.errors:
            return ErrorSummary()
        values = np.array(self.errors)
        return ErrorSummary(len(values), float(np.median(values)), float(np.percentile(values, 90)))


_Model = TypeVar("_Model", bound="TimeModel")


@dataclass
class TimeModel:
    """``seconds = coef . features(x)``, refitted on a window of recent samples."""

    coef: list[float]
    samples: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    error: ErrorLog = field(default_factory=ErrorLog)
    stale: bool = False  # samples arrived that the coefficients were not refitted on

    # each model's feature vector of its own inputs (bytes; new and cached tokens)
    features: ClassVar[Callable[..., list[float]]]

    def predict(self, *x: float) -> float:
        return max(float(np.dot(self.coef, self.features(*x))), 0.0)

    def observe(self, *x: float, seconds: float, refit: bool = True) -> None:
        """Record a real measurement: log the prediction error, then refit; ``refit=False``
        leaves the refit to ``refit_stale`` (a caller with a request waiting for its first
        token refits after it: a robust refit takes milliseconds)."""
        self.error.record(self.predict(*x), seconds)
        self.samples.append((*x, seconds))
        if refit:
            self.refit()
        else:
            self.stale = True

    def refit_stale(self) -> None:
        """Refit if samples arrived since the last refit (``observe(..., refit=False)``)."""
        if self.stale:
            self.stale = False
            self.refit()

    def refit(self) -> None:
        data = np.array(self.samples, dtype=float).reshape(len(self.samples), -1)
        data = data[np.all(np.isfinite(data), axis=1)]  # a NaN or infinite timing is no sample
        if len({tuple(row[:-1]) for row in data}) < 2 * len(self.coef):
            return  # too few distinct inputs to separate the terms reliably
        features = np.array([self.features(*row[:-1]) for row in data])
        # Relative errors: a 3 MiB restore counts as much as a 300 MiB one (predictions are judged relatively).
        times = np.maximum(data[:, -1], 1e-9)
        coef = [float(c) for c in robust_fit(features, times)]
        if not self.plausible(coef):
            coef = self.repaired(coef, features, times)
        if self.plausible(coef):
            self.coef = coef
        else:
            log.info("%s: fit %s rejected (not a plausible figure), keeping %s", type(self).__name__, coef, self.coef)

    def repaired(self, coef: list[float], features: np.ndarray, times: np.ndarray) -> list[float]:
        """A plausible fit from an implausible one where part of it still holds; by
        default none (the fit is rejected whole)."""
        return coef

    @classmethod
    def plausible(cls, coef: list[float]) -> bool:
        """Whether these coefficients can describe a real machine: finite, non-negative."""
        return all(math.isfinite(c) and c >= 0 for c in coef)

    def to_dict(self) -> dict:
        return {"coef": self.coef, "samples": [list(s) for s in self.samples]}

    @classmethod
    def from_dict(cls: type[_Model], d: dict) -> _Model:
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

    @classmethod
    def plausible(cls, coef: list[float]) -> bool:
        """Also: a setup below ``MAX_SETUP_S`` and a bandwidth below ``MAX_BYTES_PER_S``
        (a zero per-byte term, an infinitely fast link, is what a fit of samples that
        do not grow with their bytes gives)."""
        return super().plausible(coef) and coef[0] <= MAX_SETUP_S and coef[1] * MAX_BYTES_PER_S >= 1.0

    def repaired(self, coef: list[float], features: np.ndarray, times: np.ndarray) -> list[float]:
        """Samples whose times do not grow with their bytes (a link whose setup dwarfs
        the transfer of the sizes measured, such as a Redis far away) fit an infinitely
        fast link: that bandwidth is rejected and the previous one kept, and the setup is
        measured again under it (the median of what each sample leaves after its bytes).
        Samples faster than the kept bandwidth allows leave no setup: the whole previous
        fit stays."""
        per_byte = self.coef[1]
        setup = float(np.median(times - features[:, 1] * per_byte))
        return [setup, per_byte] if setup > 0 else list(self.coef)

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

    def page_seconds(self, page_size: int, index: int) -> float:
        """Recomputing page ``index`` (0: a prompt's first) of ``page_size`` tokens after the
        pages before it: ``c1*n + c2*n*(p + n/2)`` with ``p = index * n`` (without ``c0``: a
        step's fixed cost is paid whatever it computes), what keeping the page saves."""
        _, c1, c2 = self.coef
        n = page_size
        return c1 * n + c2 * n * (index * n + n / 2)

    def page_costs(self, page_size: int) -> Callable[[int], float]:
        """What a store prices each page index by (``TieredStore.page_cost.by_index``: the
        engine's and the replay's): its ``page_seconds`` over the first page's, under the
        fit as it stands when the page is priced. Relative, because a policy keeps each
        page's price from when it came, and the fit moves as prefill is observed (the
        first, cold prefills are slow): in seconds, pages priced under a slow early fit
        would outlive every page priced after it, the newest request's own pages first."""
        return partial(self.relative_page_seconds, page_size)

    def relative_page_seconds(self, page_size: int, index: int) -> float:
        """``page_seconds`` of page ``index`` in units of a first page's (1.0 for every page
        when the fit has no attention term)."""
        first = self.page_seconds(page_size, 0)
        return self.page_seconds(page_size, index) / first if first > 0 else 1.0

    @classmethod
    def plausible(cls, coef: list[float]) -> bool:
        """Also: every new token costs some time (``c1 >= MIN_TOKEN_S``)."""
        return super().plausible(coef) and coef[1] >= MIN_TOKEN_S
