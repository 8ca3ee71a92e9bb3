"""Restore-or-recompute decisions through the engine, flipping for the right reason."""

import json

import pytest

from kvtier.costmodel.models import ComputeModel, LinkModel
from kvtier.costmodel.profile import Profile
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.page import reusable_pages

from .. import cli
from ..engine.conftest import loaded, mlx_lm_greedy, on_tiny_model, text_prompt  # noqa: F401  (fixture)

PAGE = 64
GREEDY = SamplingParams(max_tokens=4)


def engine_for(loaded, store_dir, throttle=None, l1_bytes=1 << 30):
    store = StoreConfig(
        l1_bytes=l1_bytes, l2_bytes=1 << 30, l3_bytes=1 << 30, store_dir=store_dir, throttle=throttle or {}
    )
    return Engine(loaded, EngineConfig(page_size=PAGE, store=store))


def test_throttled_l3_is_recomputed_and_unthrottled_is_restored(loaded, tmp_path):
    prompt = text_prompt(loaded, 6 * PAGE + 3, seed=21)
    first = engine_for(loaded, tmp_path)
    first.generate([prompt], GREEDY)
    first.close()

    slow = engine_for(loaded, tmp_path, throttle={"L3": 2 << 20})  # 2 MiB/s
    (request,) = slow.generate([prompt], GREEDY)
    slow.close()
    assert request.plan.restore_pages == 0  # too slow to restore from were all pages there: L3 not even asked
    assert slow.stats().store.tiers["L3"].lookups == 0 and slow.stats().store.reads_abandoned == 0
    assert request.sources()["recomputed"] == len(prompt)
    assert request.output == mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)

    fast = engine_for(loaded, tmp_path)
    (request,) = fast.generate([prompt], GREEDY)
    fast.close()
    assert request.plan.restore_pages == 6
    assert request.sources()["L3"] == reusable_pages(len(prompt), PAGE) * PAGE


def test_short_prefix_is_recomputed_when_setup_dominates(loaded):
    engine = engine_for(loaded, None, l1_bytes=0)  # pages live in L2
    engine.profile = Profile(
        {"L2->L1": LinkModel.of(0.05, 1 << 30), "L3->L2": LinkModel.of(0.05, 1 << 30)}, ComputeModel([0.0, 1e-4, 0.0])
    )
    short, long = text_prompt(loaded, PAGE + 5, seed=1), text_prompt(loaded, 20 * PAGE + 5, seed=2)
    engine.generate([short, long], GREEDY)
    again_short, again_long = engine.generate([short, long], GREEDY)
    assert again_short.plan.matched == ["L2"] and again_short.sources()["recomputed"] == len(short)
    plan = again_long.plan  # every page reused (some computed while the others load)
    assert plan.restore_pages == 20 and again_long.sources()["L2"] == (20 - plan.overlap_pages) * PAGE
    assert again_long.output == mlx_lm_greedy(loaded, long, GREEDY.max_tokens)


def test_overlapped_plan_computes_the_front_while_the_back_loads(loaded, tmp_path):
    """A link as slow as compute: the planner splits (Cake); the output is unchanged and
    each page is labelled by where it came from. Every page is then in L1, those it
    computed over L3's copies too: the next request reads none of them from L3 again."""
    prompt = text_prompt(loaded, 12 * PAGE + 7, seed=31)
    first = engine_for(loaded, tmp_path)
    first.generate([prompt], GREEDY)
    first.close()
    per_page = 0.05  # seconds to compute or to load a page, as the planner sees it
    engine = engine_for(loaded, tmp_path, throttle={"L3": 1.5 * loaded.geometry(PAGE).nbytes / per_page})
    engine.profile = Profile(
        {**Profile.defaults().links, "L3->L1": LinkModel.of(0.0, 1 << 40)}, ComputeModel([0.0, per_page / PAGE, 0.0])
    )
    (request,) = engine.generate([prompt], GREEDY)
    plan = request.plan
    (again,) = engine.generate([prompt], GREEDY)
    engine.close()
    assert again.plan.matched == ["L1"] * 12
    assert plan.matched == ["L3"] * 12 and plan.restore_pages == 12 and 0 < plan.overlap_pages < 12
    assert plan.predicted_s < min(plan.recompute_s, 12 * 1.5 * per_page)
    sources = request.sources()
    assert sources["L3"] == (12 - plan.overlap_pages) * PAGE
    assert sources["recomputed"] == len(prompt) - sources["L3"]
    assert request.output == mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)
    assert json.dumps(engine.result(request)["plan"])  # shown in --json


def test_restores_refine_the_link_model_and_record_errors(loaded):
    engine = engine_for(loaded, None, l1_bytes=0)
    samples = len(engine.profile.links["L2->L1"].samples)
    for n in (2, 4, 8):
        prompt = text_prompt(loaded, n * PAGE + 1, seed=n)
        engine.generate([prompt], GREEDY)
        engine.generate([prompt], GREEDY)
    assert len(engine.profile.links["L2->L1"].samples) == samples + 3
    summary = engine.stats().costmodel
    assert summary is not None and summary.compute is not None
    assert summary.links["L2->L1"].error.count == 3
    assert summary.compute.error.count >= 1


@pytest.mark.slow  # a calibrate subprocess, then a run
def test_calibrate_saves_a_profile_that_runs_use(tmp_path):
    def kvtier(*args):
        done = cli.run(on_tiny_model(args))
        assert done.returncode == 0, done.stderr
        return done.stdout

    out = kvtier("calibrate", "--store", str(tmp_path))
    assert "L2->L1" in out and "L3->L2" in out and "prefill" in out
    lines = kvtier("run", "--json", "--store", str(tmp_path), "--prompt", "hello " * 50, "--max-tokens", "2")
    counters = json.loads(lines.splitlines()[-1])["counters"]
    assert counters["costmodel"]["calibrated"] is True
    assert not list(tmp_path.glob("calibration-*")), "the scratch store must be removed"
