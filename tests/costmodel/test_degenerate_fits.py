"""A fit no machine can have is never adopted, nor loaded, nor shown (issue 21)."""

import math

import pytest

from kvtier.costmodel.models import MAX_BYTES_PER_S, ComputeModel, LinkModel
from kvtier.costmodel.profile import GIB, Profile

MIB = 1 << 20


def flat_times_link() -> LinkModel:
    """Restores whose time does not grow with their bytes: the per-byte term fits to 0,
    an infinitely fast link (issue 21: ``setup 9.113 ms, 2.5e17 GiB/s``)."""
    link = LinkModel.of(2e-3, 0.5 * GIB)
    for pages in (1, 2, 4, 8):
        link.samples.append((pages * 3 * MIB, 9.113e-3))
    return link


def test_a_fit_of_flat_times_is_rejected_and_the_defaults_kept():
    link = flat_times_link()
    link.refit()
    assert link.setup_s == pytest.approx(2e-3) and link.bytes_per_s == pytest.approx(0.5 * GIB)


def test_online_refinement_keeps_the_previous_fit_over_a_degenerate_one():
    link = LinkModel.of(1.0, 1.0)
    for size in (1, 2, 4, 8):
        link.observe(size * MIB, seconds=0.002 + size * MIB / (3 << 30))
    good = list(link.coef)
    assert link.bytes_per_s == pytest.approx(3 << 30, rel=1e-3)
    for size in (16, 32, 64, 128, 256, 512, 1024, 2048):  # a window of flat times takes over
        link.observe(size * MIB, seconds=0.001)
    assert link.coef == pytest.approx(good, rel=1e-9)
    assert math.isfinite(link.bytes_per_s) and link.bytes_per_s <= MAX_BYTES_PER_S


def test_a_nan_timing_is_no_sample():
    link = LinkModel.of(1.0, 1.0)
    for size in (1, 2, 4, 8):
        link.observe(size * MIB, seconds=0.002 + size * MIB / (3 << 30))
    link.observe(16 * MIB, seconds=float("nan"))
    assert all(math.isfinite(c) for c in link.coef)
    assert link.bytes_per_s == pytest.approx(3 << 30, rel=1e-3)


def test_a_free_prefill_is_rejected():
    compute = ComputeModel([1e-3, 1e-3, 0.0])
    for n in (16, 32, 64):
        for p in (0, 128):
            compute.samples.append((n, p, 0.05))  # every length the same time: c1 = 0
    compute.refit()
    assert compute.coef == [1e-3, 1e-3, 0.0]


def test_a_stored_degenerate_profile_loads_with_the_defaults_and_stats_show_no_absurd_figure():
    """A profile an older kvtier saved with such a fit: ``kvtier stats`` (``summary``)
    shows the default link, not infinite or absurd GiB/s, nor a negative setup."""
    saved = Profile.defaults().to_dict()
    saved["links"]["L3->L1"]["coef"] = [9.113e-3, 1e-30]
    saved["links"]["L2->L1"]["coef"] = [-1e-3, 1e-9]
    saved["compute"]["coef"] = [float("nan"), 1e-3, 0.0]
    summary = Profile.from_dict(saved).summary().to_json()
    defaults = Profile.defaults().summary().to_json()
    for name in ("L3->L1", "L2->L1"):
        assert summary["links"][name]["gib_s"] == pytest.approx(defaults["links"][name]["gib_s"])
        assert summary["links"][name]["setup_s"] == pytest.approx(defaults["links"][name]["setup_s"])
    assert summary["compute"]["c0"] == defaults["compute"]["c0"]


def test_a_link_whose_setup_dwarfs_its_transfers_keeps_that_setup():
    """Times flat in the bytes but well above what the kept bandwidth needs (a Redis far
    away): the bandwidth stays, the setup is what the samples measure."""
    link = LinkModel.of(2e-3, 0.5 * GIB)
    for pages in (1, 2, 3, 4):
        link.samples.append((pages * 64 * 1024, 0.05))
    link.refit()
    assert link.bytes_per_s == pytest.approx(0.5 * GIB) and link.setup_s == pytest.approx(0.05, rel=0.01)
