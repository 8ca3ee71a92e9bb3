"""Acceptance soak (lean; bench/soak.py runs the long one) and growth over many requests."""

import gc

import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.metrics import RateWindow
from kvtier.engine.request import Request, SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from .soak import soak, structure_sizes
from .tiny import tiny_model

PAGE = 16


def test_threaded_soak_every_request_ends_and_nothing_is_left(tmp_path):
    loaded = tiny_model()
    page_bytes = loaded.geometry(PAGE).nbytes
    store = StoreConfig(
        l1_bytes=24 * page_bytes, l2_bytes=24 * page_bytes, l3_bytes=64 * page_bytes, store_dir=tmp_path
    )
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store, max_running=8, window_s=1e-6))
    report = soak(engine, rounds=3, per_round=120, threads=8)
    engine.close()
    outcomes = report.outcomes
    assert sum(outcomes.values()) == 360
    assert {reason for _, reason in outcomes} <= {"length", "cancelled", "error"}
    assert outcomes[("keep", "length")] > 0 and outcomes[("cancel_early", "cancelled")] > 0
    assert outcomes[("fail_admit", "error")] > 0 and outcomes[("fail_publish", "error")] > 0
    assert not [k for k in outcomes if k[0].startswith("fail") and k[1] != "error"], "an injected fault was missed"
    assert not [k for k in outcomes if k[0] == "keep" and k[1] != "length"]
    assert report.wrong_outputs == 0
    totals = report.totals
    assert totals.requests + totals.cancelled + totals.errors == 360
    assert totals.errors == outcomes[("fail_admit", "error")] + outcomes[("fail_publish", "error")]
    assert report.pins == 0 and report.over_cap == []
    assert report.grown == {}, "an engine structure grew between rounds"


def test_no_structure_grows_with_the_number_of_requests():
    """Every container of the engine (and the rate window) is as long after 600 more
    requests as before them; no Request outlives its caller's references."""
    loaded = tiny_model()
    page_bytes = loaded.geometry(PAGE).nbytes
    store = StoreConfig(l1_bytes=8 * page_bytes, l2_bytes=8 * page_bytes, store_dir=None)
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store, window_s=1e-6))
    params = SamplingParams(max_tokens=2)

    def burst(first: int, n: int) -> None:
        for i in range(first, first + n, 50):  # repeated and fresh prefixes: hits, spills, flights
            engine.generate(
                [[32 + (j * 7 + k * (k % 3)) % 200 for j in range(2 * PAGE + 3)] for k in range(i, i + 50)], params
            )

    burst(0, 300)  # warm: L1 and L2 full, every structure at its working size
    before = structure_sizes(engine)
    burst(300, 600)
    gc.collect()
    assert structure_sizes(engine) == before
    assert not [o for o in gc.get_objects() if isinstance(o, Request)]


def test_the_rate_window_is_pruned_as_events_arrive():
    window = RateWindow(window_s=30.0)
    for i in range(100_000):
        window.add(1.0, now=i * 0.01)  # 1,000 s of events, 100 a second
    assert window.held() <= 30 * 100 + 1
    assert window.rate(now=1000.0) == pytest.approx(100.0, abs=0.05)  # the last 30 s: ~3,000 events of 1
