"""The cost profile of one machine and model: fitted link and compute models, their
defaults before calibration, and the key under which a model's profile is stored."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvtier.tiers.links import READ_LINKS

from .environment import environment_id
from .models import ComputeModel, LinkModel
from .summary import ComputeFit, LinkFit, ProfileSummary

log = logging.getLogger(__name__)

GIB = 1 << 30


def profile_key(namespace_digest: bytes) -> str:
    """Where a model's profile is stored: per machine, mlx version and BLAS in use
    (``environment_id``), so a profile measured under another BLAS is not found and
    the first run recalibrates instead of planning with its times."""
    return f"profile/{environment_id()}/{namespace_digest.hex()}"


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
        links = {
            "L2->L1": LinkModel.of(1e-3, 1 * GIB),
            "L3->L1": LinkModel.of(2e-3, 0.5 * GIB),
            "L3->L2": LinkModel.of(2e-3, 0.5 * GIB),
        }
        return cls(links, ComputeModel([1e-3, 1e-3, 0.0]))

    def to_dict(self) -> dict:
        return {
            "calibrated": self.calibrated,
            "compute": self.compute.to_dict(),
            "links": {name: link.to_dict() for name, link in self.links.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        """A stored profile; links it lacks (saved by an older kvtier) start at the defaults,
        and so do coefficients no machine can have (an older kvtier adopted such fits)."""
        defaults = cls.defaults()
        links = dict(defaults.links)
        links.update({name: LinkModel.from_dict(link) for name, link in d["links"].items()})
        compute = ComputeModel.from_dict(d["compute"])
        for model, default in ((compute, defaults.compute), *((links[n], defaults.links[n]) for n in defaults.links)):
            if not model.plausible(model.coef):
                model.coef = list(default.coef)
        return cls(links, compute, d.get("calibrated", False))

    @classmethod
    def stored(cls, value: object, where: str) -> Profile | None:
        """The profile a store holds under one key (``where`` names it in the warning), or
        None: absent, or damaged (one warning; the caller calibrates or uses the defaults)."""
        if value is None:
            return None
        try:
            if isinstance(value, dict) and value:
                return cls.from_dict(value)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            pass
        log.warning("%s: the stored cost profile is damaged; ignored (`kvtier calibrate` measures anew)", where)
        return None

    def refit_stale(self) -> None:
        """Refit every model that took samples since its last refit (``TimeModel.refit_stale``)."""
        for model in (self.compute, *self.links.values()):
            model.refit_stale()

    def capped(self, throttle: dict[str, float]) -> Profile:
        """A view whose throttled tiers' links are no faster than the cap (bytes/s)."""
        links = dict(self.links)
        for tier, rate in throttle.items():
            for name in READ_LINKS[tier]:
                links[name] = LinkModel.of(links[name].setup_s, min(links[name].bytes_per_s, rate))
        return Profile(links, self.compute, self.calibrated)

    def summary(self) -> ProfileSummary:
        """Fitted parameters and prediction errors, for stats."""
        links = {
            name: LinkFit(link.setup_s, link.bytes_per_s / GIB, link.error.summary(), len(link.samples))
            for name, link in self.links.items()
        }
        c0, c1, c2 = self.compute.coef
        return ProfileSummary(self.calibrated, links, ComputeFit(c0, c1, c2, self.compute.error.summary()))
