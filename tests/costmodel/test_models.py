import pytest

from kvtier.costmodel.models import ComputeModel, LinkModel
from kvtier.costmodel.plan import plan_restore, restore_seconds
from kvtier.costmodel.profile import Profile
from kvtier.tiers.page import GLOBAL, LayerKind, PageGeometry, Source

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


def test_link_fit_ignores_a_time_far_too_short():
    """A too-short time weighs far more than a stall in relative terms (its error is not
    bounded by 100%): without the robust refit it drags the bandwidth to infinity."""
    link = LinkModel.of(1.0, 1.0)
    for size in [1, 2, 4, 8, 16, 32, 3, 6, 12, 24]:
        link.observe(size * MIB, seconds=0.001 + size * MIB / (2 << 30))
    link.observe(32 * MIB, seconds=1e-4)  # e.g. bytes counted that never moved
    assert link.bytes_per_s == pytest.approx(2 << 30, rel=0.01)
    assert link.setup_s == pytest.approx(0.001, rel=0.05)


def test_fits_never_go_negative():
    """Times that a negative setup would fit best: setup 0, not below."""
    link = LinkModel.of(1.0, 1.0)
    for size in (1, 2, 4, 8, 16, 32):
        link.observe(size * MIB, seconds=size * MIB / (1 << 30) - 0.0005)
    assert link.setup_s == 0.0 and 0 < link.bytes_per_s < float("inf")
    compute = ComputeModel([0.0, 0.0, 0.0])
    for n in (64, 128, 256, 512):
        for p in (0, 512):
            compute.observe(n, p, seconds=1e-3 * n - 1e-8 * n * (p + n / 2))  # attention "faster" with context
    assert min(compute.coef) >= 0.0 and compute.coef[1] > 0


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
    summary = link.error.summary()
    assert (summary.count, summary.median) == (1, pytest.approx(0.5))


def profile(
    link_gib_s: float, setup_s: float = 1e-4, per_token: float = 1e-3, join_gib_s: float | None = None
) -> Profile:
    links = {name: LinkModel.of(setup_s, link_gib_s * (1 << 30)) for name in ("L2->L1", "L3->L1", "L3->L2")}
    if join_gib_s is not None:
        links["L2->L1"] = LinkModel.of(0.0, join_gib_s * (1 << 30))
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
    assert restore_seconds([Source.L3], PAGE_BYTES, p) == pytest.approx(one_link)  # raw: L3->L1
    assert restore_seconds([Source.L3], PAGE_BYTES, p, codec="zstd") == pytest.approx(2 * one_link)
    assert restore_seconds([Source.L1], PAGE_BYTES, p) == 0.0


def test_setup_is_paid_once_per_link():
    p = profile(1.0, setup_s=0.25)
    assert restore_seconds([Source.L2] * 3, PAGE_BYTES, p) == pytest.approx(0.25 + 3 * PAGE_BYTES / (1 << 30))


def slow_reads(join_s: float = 0.001) -> Profile:
    """A page takes 0.1 s to compute, 0.1 s to read from L3, ``join_s`` to join."""
    return profile(
        PAGE_BYTES / 0.1 / (1 << 30), setup_s=0.0, per_token=0.1 / PAGE, join_gib_s=PAGE_BYTES / join_s / (1 << 30)
    )


def test_overlap_balances_compute_of_the_front_against_reads_of_the_back():
    """Computing half while the other half is read, then joining it, beats both the
    serial restore and recomputing."""
    plan = plan_restore([Source.L3] * 8, 8 * PAGE + 1, PAGE, PAGE_BYTES, slow_reads())
    assert plan.restore_pages == 8 and plan.overlap_pages == 4 and plan.first_loaded == 4
    # max(4 computed, 4 read) + 4 joined + the last token
    assert plan.predicted_s == pytest.approx(0.4 + 0.004 + 0.1 / PAGE)
    assert plan.recompute_s == pytest.approx(0.8 + 0.1 / PAGE)


def test_joins_run_after_the_overlap():
    """When joining costs as much as reading (L2 pages: the join is the whole load), an
    overlap gains nothing and the plan stays serial."""
    plan = plan_restore([Source.L2] * 8, 8 * PAGE + 1, PAGE, PAGE_BYTES, slow_reads(join_s=0.05))
    assert plan.overlap_pages == 0 and plan.restore_pages == 8


def test_no_overlap_when_loads_are_cheap():
    plan = plan_restore([Source.L3] * 8, 8 * PAGE + 1, PAGE, PAGE_BYTES, profile(100.0))
    assert plan.restore_pages == 8 and plan.overlap_pages == 0


def test_overlap_starts_after_the_leading_l1_pages_and_never_loads_an_l1_page():
    p = slow_reads(join_s=1e-9)
    plan = plan_restore([Source.L1] * 2 + [Source.L3] * 6, 8 * PAGE + 1, PAGE, PAGE_BYTES, p)
    assert plan.l1_pages == 2 and plan.overlap_pages == 3 and plan.first_loaded == 5
    # Overlapping would load the L1 page on the loader thread (device memory off the
    # model's thread): restored serially, the L1 page used, 0.7 s either way.
    plan = plan_restore([Source.L3, Source.L3, Source.L1] + [Source.L3] * 5, 8 * PAGE + 1, PAGE, PAGE_BYTES, p)
    assert plan.l1_pages == 0 and plan.overlap_pages == 0 and plan.restore_pages >= 3
    assert plan.predicted_s == pytest.approx(0.7 + 0.1 / PAGE)


@pytest.mark.parametrize("l1_at", range(1, 8))
def test_no_load_range_contains_an_l1_page(l1_at):
    """Wherever one L1 page sits after the lead, the loaded range stays clear of it."""
    matched = [Source.L3] * 8
    matched[l1_at] = Source.L1
    for join_s in (1e-9, 0.001, 0.05):
        plan = plan_restore(matched, 8 * PAGE + 1, PAGE, PAGE_BYTES, slow_reads(join_s))
        assert plan.restore_pages > l1_at  # the L1 page is used
        assert not plan.overlap_pages or "L1" not in plan.matched[plan.first_loaded : plan.restore_pages]


def test_profile_round_trips():
    p = profile(2.0)
    p.links["L2->L1"].observe(MIB, seconds=0.01)
    again = Profile.from_dict(p.to_dict())
    assert again.links["L2->L1"].coef == p.links["L2->L1"].coef
    assert list(again.links["L2->L1"].samples) == list(p.links["L2->L1"].samples)


def test_a_window_models_restore_is_priced_at_the_rows_it_reads():
    """One global and one sliding-window layer (window 2 pages): a restore of 8 L3 pages
    reads every page's global rows and the window rows of the last 2 pages only, so it
    is priced at 8 + 2 half pages, serially (never overlapped)."""
    geometry = PageGeometry(2, 1, 64, PAGE, "float32", (GLOBAL, LayerKind("window", window=2 * PAGE)))
    half = geometry.nbytes // 2  # each layer's rows
    p = slow_reads()
    plan = plan_restore([Source.L3] * 8, 8 * PAGE + 1, PAGE, geometry.nbytes, p, window=geometry)
    assert plan.restore_pages == 8 and plan.overlap_pages == 0
    read = p.links["L3->L1"].predict((8 + 2) * half)
    assert plan.predicted_s == pytest.approx(read + p.compute.predict(1, 8 * PAGE))
    whole = plan_restore([Source.L3] * 8, 8 * PAGE + 1, PAGE, geometry.nbytes, p)  # every row priced
    assert whole.predicted_s > plan.predicted_s


def test_a_hybrid_plan_prices_the_snapshot_it_reads():
    """Pages 0-1 in L1, 2-3 in L3, snapshots after pages 2 and 4: a state that takes
    longer to read from L3 than computing two pages makes the earlier point (its snapshot
    beside an L1 page, free) win; a small state keeps the longer restore."""
    matched = [Source.L1, Source.L1, Source.L3, Source.L3]
    slow = profile(link_gib_s=1.0)  # 1 GiB/s: 1 GiB of state is ~1 s, two pages' compute 0.256 s
    small = plan_restore(matched, 6 * PAGE, PAGE, PAGE_BYTES, slow, points=[2, 4], snapshot_bytes=MIB)
    big = plan_restore(matched, 6 * PAGE, PAGE, PAGE_BYTES, slow, points=[2, 4], snapshot_bytes=1 << 30)
    assert small.restore_pages == 4
    assert big.restore_pages == 2
