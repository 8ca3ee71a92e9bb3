"""The cost profile of one machine and model, and restore-or-recompute plans (DESIGN §6)."""

from __future__ import annotations

import platform
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from tiers.page import Source

from .models import ComputeModel, LinkModel

GIB = 1 << 30
# Links a page crosses on its way into a request's KV, by the tier it is found in.
PATH = {Source.L1: (), Source.L2: ("L2->L1",), Source.L3: ("L3->L2", "L2->L1")}
# The link that reads from a tier (what a read throttle on that tier slows).
READ_LINK = {"L2": "L2->L1", "L3": "L3->L2"}


def machine_id() -> str:
    """Which machine a profile was measured on."""
    return f"{platform.node()}/{platform.machine()}"


def profile_key(namespace_digest: bytes) -> str:
    return f"profile/{machine_id()}/{namespace_digest.hex()}"


@dataclass
class Profile:
    """Fitted link and compute models; ``calibrated`` once ``kvtier calibrate`` ran."""

    links: dict[str, LinkModel]
    compute: ComputeModel
    calibrated: bool = False

    @classmethod
    def defaults(cls) -> Profile:
        """Guesses for an uncalibrated machine: slow links (1 and 0.5 GiB/s), and prefill at
        1 ms a token. Wrongly recomputing a long prefix costs far more than wrongly
        restoring a short one, so the guesses lean towards restoring."""
        links = {"L2->L1": LinkModel.of(1e-3, 1 * GIB), "L3->L2": LinkModel.of(2e-3, 0.5 * GIB)}
        return cls(links, ComputeModel([1e-3, 1e-3, 0.0]))

    def to_dict(self) -> dict:
        return {"calibrated": self.calibrated, "compute": self.compute.to_dict(),
                "links": {name: link.to_dict() for name, link in self.links.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        links = {name: LinkModel.from_dict(link) for name, link in d["links"].items()}
        return cls(links, ComputeModel.from_dict(d["compute"]), d.get("calibrated", False))

    def capped(self, throttle: dict[str, float]) -> Profile:
        """A view whose throttled tiers' links are no faster than the cap (bytes/s)."""
        links = dict(self.links)
        for tier, rate in throttle.items():
            link = links[READ_LINK[tier]]
            links[READ_LINK[tier]] = LinkModel.of(link.setup_s, min(link.bytes_per_s, rate))
        return Profile(links, self.compute, self.calibrated)

    def summary(self) -> dict:
        """Fitted parameters and prediction errors, for stats."""
        links = {name: {"setup_s": link.setup_s, "gib_s": link.bytes_per_s / GIB, "error": link.error.summary()}
                 for name, link in self.links.items()}
        c0, c1, c2 = self.compute.coef
        compute = {"c0": c0, "c1": c1, "c2": c2, "error": self.compute.error.summary()}
        return {"calibrated": self.calibrated, "links": links, "compute": compute}


@dataclass
class RestorePlan:
    """Which leading matched pages to restore; the rest of the prompt is recomputed."""

    matched: list[str]  # tier of each matched page, in prompt order
    restore_pages: int
    predicted_s: float  # predicted restore + prefill time of the chosen plan
    recompute_s: float  # predicted prefill time with nothing restored

    def to_dict(self) -> dict:
        return {"matched": self.matched, "restore_pages": self.restore_pages,
                "predicted_s": round(self.predicted_s, 6), "recompute_s": round(self.recompute_s, 6)}


def restore_seconds(sources: Sequence[Source], page_bytes: int, profile: Profile) -> float:
    """Predicted time to bring these pages into a request's KV."""
    moved: Counter[str] = Counter()
    for source in sources:
        for link in PATH[source]:
            moved[link] += page_bytes
    return sum(profile.links[link].predict(nbytes) for link, nbytes in moved.items())


def plan_restore(matched: Sequence[Source], prompt_tokens: int, page_size: int,
                 page_bytes: int, profile: Profile) -> RestorePlan:
    """Restore the prefix of ``matched`` that minimises restore + prefill time.

    Restores are serial with prefill here (the engine restores, then mlx-lm
    prefills the rest), so a plan costs their sum. Pages in L1 are always used,
    so the prefix reaches at least the last L1 page.
    """
    l1 = [i for i, s in enumerate(matched) if s is Source.L1]
    shortest = l1[-1] + 1 if l1 else 0
    best_k, best_s = shortest, float("inf")
    for k in range(shortest, len(matched) + 1):
        cached = k * page_size
        seconds = (restore_seconds(matched[:k], page_bytes, profile)
                   + profile.compute.predict(prompt_tokens - cached, cached))
        if seconds < best_s:
            best_k, best_s = k, seconds
    recompute = profile.compute.predict(prompt_tokens, 0)
    return RestorePlan([s.value for s in matched], best_k, best_s, recompute)
