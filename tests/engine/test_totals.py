"""The engine's typed totals: what each ending adds, and the JSON shape that
``Engine.stats().to_json()["engine"]``, the Prometheus export and a store's persisted counters read."""

from kvtier.engine.request import Request, SamplingParams
from kvtier.engine.serve.prometheus import ENGINE_COUNTERS
from kvtier.engine.stats import EngineStats, Window
from kvtier.engine.totals import EngineTotals
from kvtier.tiers.stats import L3Place, StoreStats

SHAPE = [
    "requests",
    "prompt_tokens",
    "generated_tokens",
    "store_seconds",
    "l1_hit_loss_tokens",
    "sources",
    "cancelled",
    "errors",
    "waited_tokens",
    "wait_s",
]


def ended(reason: str, prompt_tokens: int = 10, output: int = 3) -> Request:
    request = Request(0, list(range(prompt_tokens)), SamplingParams(), 4, [])
    request.output = list(range(output))
    request.l1_tokens_at_enqueue, request.l1_tokens_at_admission = 8, 4
    request.waited_tokens, request.wait_s = 4, 0.5
    request.finish_reason = reason
    return request


def test_a_finished_request_counts_in_full_the_others_only_by_how_they_ended():
    totals = EngineTotals()
    for reason in ("length", "stop", "cancelled", "error", "error"):
        totals.count(ended(reason))
    assert (totals.requests, totals.cancelled, totals.errors) == (2, 1, 2)
    assert (totals.prompt_tokens, totals.generated_tokens, totals.l1_hit_loss_tokens) == (20, 6, 8)
    assert (totals.waited_tokens, totals.wait_s) == (8, 1.0)
    assert totals.sources == {"L1": 0, "L2": 0, "L3": 0, "recomputed": 20}


def test_the_json_shape_is_kept_and_is_a_copy():
    totals = EngineTotals()
    totals.count(ended("length"))
    shape = totals.to_dict()
    assert list(shape) == SHAPE and set(ENGINE_COUNTERS) <= set(shape)
    totals.count(ended("length"))
    assert shape["requests"] == 1 and shape["sources"]["recomputed"] == 10, "later counting leaves it alone"


def test_a_snapshot_is_left_alone_by_later_counting():
    totals = EngineTotals()
    totals.count(ended("length"))
    snapshot = totals.snapshot()
    totals.count(ended("length"))
    assert (snapshot.requests, snapshot.sources["recomputed"]) == (1, 10)
    assert (totals.requests, totals.sources["recomputed"]) == (2, 20)


def test_engine_stats_json_keeps_its_parts_in_order():
    window = Window(30.0, 1.5)
    stats = EngineStats(EngineTotals(), window, {"calibrated": False}, StoreStats({}, {}, L3Place("lmdb", "/s")))
    shape = stats.to_json()
    assert list(shape) == ["engine", "windowed", "costmodel", "tiers", "links", "l3"]
    assert shape["windowed"] == {"window_s": 30.0, "cached_tokens_per_s": 1.5} and list(shape["engine"]) == SHAPE
    assert list(EngineStats(EngineTotals(), window, {}).to_json()) == ["engine", "windowed", "costmodel"]
