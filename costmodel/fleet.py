"""Where a request goes in a fleet of engines (DESIGN §11): the backend whose predicted
time to first token is least, ``T = Q + X + P`` (its queue, restoring the prefix it can
reach, computing the rest), among the backends whose load is within a bound of the
least loaded one.

One rule for the router (``kvtier route``) and the fleet replay (``kvtier replay
--engines``), so that what the replay ranks is what the router does. The caller says
what each backend would find of the prompt (``Candidate.matched``: its own L1 and L2
pages, then what only the shared L3 holds, in prompt order) and how much work is ahead
of a new request there; the restore-or-recompute choice per backend is its own plan
(``plan_restore``) over that backend's measured profile, so a backend with a slow link
to the shared L3 is priced as such.

The load bound is Preble's exploit/explore: a backend whose load (requests running and
waiting) exceeds the least loaded backend's by more than ``max_imbalance`` is not
chosen even if it holds the whole prefix, so one hot system prompt cannot pin all
traffic to one engine; the pages it holds are then restored from the shared L3 or
recomputed elsewhere, and the engine that computes them publishes them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvtier.tiers.page import Source

from .plan import RestorePlan, plan_restore
from .profile import Profile


@dataclass(frozen=True)
class Candidate:
    """One backend as the chooser sees it for one prompt.

    ``matched``: the source of each of the prompt's leading pages on this backend, in
    prompt order, up to the first page it cannot reach (``L1``/``L2``: its own tiers;
    ``L3``: the shared store). ``pending_tokens``: prompt tokens queued or being
    prefilled there, which a new request waits behind. ``load``: requests running and
    waiting there."""

    name: str
    matched: tuple[Source, ...]
    pending_tokens: int
    load: int
    profile: Profile


class Reason(str, Enum):
    """Why the chosen backend won: it was the fastest overall (``fastest``), or backends
    predicted faster were over the load bound (``balanced``)."""

    FASTEST = "fastest"
    BALANCED = "balanced"


@dataclass(frozen=True)
class Estimate:
    """A backend's predicted time to first token: queue + (restore + compute)."""

    name: str
    queue_s: float
    plan: RestorePlan
    eligible: bool  # within the load bound

    @property
    def predicted_s(self) -> float:
        return self.queue_s + self.plan.predicted_s


@dataclass(frozen=True)
class Placement:
    """The choice and every backend's estimate (for logs, headers and the replay)."""

    backend: str
    reason: Reason
    estimates: tuple[Estimate, ...]

    @property
    def chosen(self) -> Estimate:
        return next(e for e in self.estimates if e.name == self.backend)


def queue_seconds(candidate: Candidate) -> float:
    """The prefill work ahead of a new request on this backend, priced by its profile."""
    return candidate.profile.compute.predict(candidate.pending_tokens, 0) if candidate.pending_tokens else 0.0


def estimate(
    candidate: Candidate, prompt_tokens: int, page_size: int, page_bytes: int, eligible: bool = True
) -> Estimate:
    """The backend's predicted time to first token for this prompt."""
    plan = plan_restore(candidate.matched, prompt_tokens, page_size, page_bytes, candidate.profile)
    return Estimate(candidate.name, queue_seconds(candidate), plan, eligible)


def choose(
    candidates: Sequence[Candidate], prompt_tokens: int, page_size: int, page_bytes: int, max_imbalance: int
) -> Placement:
    """The eligible backend with the least predicted time to first token (ties: the least
    loaded, then the first given). ``max_imbalance`` >= 0; at least one candidate."""
    if not candidates:
        raise ValueError("no backend to choose from")
    if max_imbalance < 0:
        raise ValueError("max_imbalance must be >= 0")
    least = min(c.load for c in candidates)
    estimates = tuple(
        estimate(c, prompt_tokens, page_size, page_bytes, c.load - least <= max_imbalance) for c in candidates
    )
    order = {e.name: i for i, e in enumerate(estimates)}
    loads = {c.name: c.load for c in candidates}

    def rank(e: Estimate) -> tuple[float, int, int]:
        return e.predicted_s, loads[e.name], order[e.name]

    best = min((e for e in estimates if e.eligible), key=rank)
    fastest = min(estimates, key=rank)
    return Placement(best.name, Reason.FASTEST if best is fastest else Reason.BALANCED, estimates)
