"""Snapshot spacing of hybrid models: the cost model's choice, and the prefill cut at it."""

from __future__ import annotations

from kvtier.costmodel.models import ComputeModel
from kvtier.costmodel.profile import Profile
from kvtier.costmodel.spacing import choose_spacing, prefill_segments, snapshot_pages

PAGE = 256
PROMPT = 16384  # 63 full pages before the last token


def profile(per_token_s: float = 2e-4) -> Profile:
    return Profile(Profile.defaults().links, ComputeModel([5e-3, per_token_s, 0.0]))


def test_a_larger_state_is_snapshotted_more_sparsely():
    sizes = [64 << 10, 4 << 20, 64 << 20, 512 << 20]
    chosen = [choose_spacing(profile(), PAGE, size, PROMPT) for size in sizes]
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]
    assert all(1 <= s <= (PROMPT - 1) // PAGE for s in chosen)


def test_a_slower_prefill_is_snapshotted_more_densely():
    chosen = [choose_spacing(profile(per_token), PAGE, 16 << 20, PROMPT) for per_token in (2e-5, 2e-4, 2e-3)]
    assert chosen == sorted(chosen, reverse=True) and chosen[0] > chosen[-1]


def test_the_prefill_is_cut_at_every_snapshot_after_the_restored_prefix():
    prompt = list(range(1000))
    points = snapshot_pages(len(prompt), 64, 4)
    assert points == [4, 8, 12, 15]  # every 4 pages, and the last full page before the last token
    segments = prefill_segments(prompt, 300, 64, points)
    assert [t for s in segments for t in s] == prompt[300:]
    assert [s[-1] + 1 for s in segments[:-1]] == [p * 64 for p in points if p * 64 > 300]
