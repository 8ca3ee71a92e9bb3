import numpy as np
import pytest

from costmodel.models import ComputeModel, LinkModel
from costmodel.plan import Profile, plan_restore, restore_seconds
from tiers.page import Source

MIB = 1 << 20


def test_link_fit_recovers_setup_and_bandwidth():
    link = LinkModel.of(1.0, 1.0)  # a wrong start
    for size in (1, 2, 4, 8, 16, 32):
        link.observe(size * MIB, seconds=0.002 + size * MIB / (3 << 30))
    assert link.setup_s == pytest.approx(0.002, rel=1e-3)
    assert link.bytes_per_s == pytest.approx(3 << 30, rel=1e-3)


def test_link_fit_ignores_an_outlier():
    link = LinkModel.of(1.0, 1.0)
    sizes = [1, 2, 4, 8, 16, 32, 3, 6, 12, 24]
    for size in sizes:
        link.observe(size * MIB, seconds=0.001 + size * MIB / (2 << 30))
    link.observe(4 * MIB, seconds=5.0)  # the machine stalled once
    assert link.bytes_per_s == pytest.approx(2 << 30, rel=0.01)


def test_compute_fit_recovers_attention_term():
    model = ComputeModel([0.0, 0.0, 0.0])
    truth = (0.01, 1e-3, 1e-7)
    for n in (64, 128, 256, 512):
        for p in (0, 512, 1024):
            model.observe(n, p, seconds=truth[0] + truth[1] * n + truth[2] * n * (p + n / 2))
    assert model.coef == pytest.approx(list(truth), rel=1e-3)
    assert model.predict(0, 100) == 0.0


def test_prediction_errors_are_recorded():
    link = LinkModel.of(0.0, 1 << 30)
    link.observe(1 << 30, seconds=2.0)  # predicted 1 s, measured 2 s
    assert link.error.summary()["median"] == pytest.approx(0.5)


def profile(link_gib_s: float, setup_s: float = 1e-4, per_token: float = 1e-3) -> Profile:
    links = {"L2->L1": LinkModel.of(setup_s, link_gib_s * (1 << 30)),
             "L3->L2": LinkModel.of(setup_s, link_gib_s * (1 << 30))}
    return Profile(links, ComputeModel([0.0, per_token, 0.0]))


PAGE, PAGE_BYTES = 128, 3 * MIB


def test_fast_links_restore_everything():
    plan = plan_restore([Source.L3] * 4, 600, PAGE, PAGE_BYTES, profile(5.0))
    assert plan.restore_pages == 4 and plan.predicted_s < plan.recompute_s


def test_slow_links_recompute_everything():
    plan = plan_restore([Source.L3] * 4, 600, PAGE, PAGE_BYTES, profile(0.001))
    assert plan.restore_pages == 0 and plan.predicted_s == pytest.approx(plan.recompute_s)


def test_setup_dominated_short_prefix_is_recomputed():
    slow_setup = profile(5.0, setup_s=0.5)
    assert plan_restore([Source.L2], 200, PAGE, PAGE_BYTES, slow_setup).restore_pages == 0
    assert plan_restore([Source.L2] * 40, 41 * PAGE, PAGE, PAGE_BYTES, slow_setup).restore_pages == 40


def test_l1_pages_are_always_used():
    plan = plan_restore([Source.L3, Source.L1], 300, PAGE, PAGE_BYTES, profile(0.001))
    assert plan.restore_pages == 2


def test_restore_seconds_counts_each_link_crossed():
    p = profile(1.0, setup_s=0.0)
    one_link = restore_seconds([Source.L2], PAGE_BYTES, p)
    assert restore_seconds([Source.L3], PAGE_BYTES, p) == pytest.approx(2 * one_link)
    assert restore_seconds([Source.L1], PAGE_BYTES, p) == 0.0


def test_profile_round_trips():
    p = profile(2.0)
    p.links["L2->L1"].observe(MIB, seconds=0.01)
    again = Profile.from_dict(p.to_dict())
    assert again.links["L2->L1"].coef == p.links["L2->L1"].coef
    assert list(again.links["L2->L1"].samples) == list(p.links["L2->L1"].samples)
