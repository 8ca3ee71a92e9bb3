"""The engine's typed totals: what each ending adds, and the JSON shape that
``Engine.stats().to_json()["engine"]``, the Prometheus export and a store's persisted counters read."""

from kvtier.costmodel.profile import Profile
from kvtier.engine.request import Request, SamplingParams
from kvtier.engine.serve.prometheus import ENGINE_COUNTERS, format_stats
from kvtier.engine.stats import EngineStats, LastRun, Window
from kvtier.engine.totals import EngineTotals
from kvtier.tiers.counters import LinkStats, TierStats
from kvtier.tiers.links import Link
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
    summary = Profile.defaults().summary()
    stats = EngineStats(EngineTotals(), window, summary, StoreStats({}, {}, L3Place("lmdb", "/s")))
    shape = stats.to_json()
    assert list(shape) == ["engine", "windowed", "costmodel", "tiers", "links", "l3", "reads_abandoned"]
    assert shape["windowed"] == {"window_s": 30.0, "cached_tokens_per_s": 1.5} and list(shape["engine"]) == SHAPE
    assert list(EngineStats(EngineTotals(), window, summary).to_json()) == ["engine", "windowed", "costmodel"]


def persisted_stats() -> tuple[EngineStats, dict]:
    """What a store's counters read back as, after one process with these counters closed."""
    l1, l3 = TierStats(capacity=64, bytes_used=32, pages=2, hit_pages=5), TierStats(capacity=99, inserts=3)
    live = StoreStats({"L1": l1, "L3": l3}, {Link.L3_L1: LinkStats(4096, 2, 0.5)})
    totals = EngineTotals()
    totals.count(ended("length"))
    counters = {**live.cumulative(), "engine": totals.to_dict()}
    last = LastRun("m", Window(30.0, 2.0), Profile.defaults().summary()).to_json()
    now = TierStats(capacity=1 << 20, bytes_used=4096, pages=1)
    return EngineStats.persisted(counters, last, L3Place("lmdb", "/s", 123), now), counters


def test_persisted_counters_read_back_typed_with_only_the_gauges_still_known():
    stats, counters = persisted_stats()
    assert stats.store is not None and stats.totals is not None and stats.last_run is not None
    assert stats.store.tiers["L1"].hit_pages == 5 and stats.store.links[Link.L3_L1].bytes == 4096
    assert not stats.store.gauged("L1") and stats.store.gauged("L3")
    shape = stats.to_json()
    assert shape["tiers"]["L1"] == counters["tiers"]["L1"], "an ended process's L1 has no gauges to report"
    assert shape["tiers"]["L3"]["capacity"] == 1 << 20 and shape["tiers"]["L3"]["inserts"] == 3
    assert shape["tiers"]["L3"]["file_bytes"] == 123 and shape["engine"] == counters["engine"]
    assert stats.last_run.windowed == Window(30.0, 2.0) and stats.last_run.costmodel == Profile.defaults().summary()
    text = format_stats(stats)
    assert 'kvtier_tier_pages{tier="L3"} 1.0' in text and 'tier="L1"' in text
    assert 'kvtier_tier_capacity{tier="L1"}' not in text, "no gauge of a tier nobody can see"
    assert "kvtier_tier_file_bytes" in text and "kvtier_requests_total 1.0" in text


def test_damaged_persisted_counters_are_read_as_far_as_they_go():
    counters = {"tiers": {"L1": {"hit_pages": "x", "inserts": 2}, "L2": "junk"}, "links": {"nowhere": {}}, "engine": 7}
    stats = EngineStats.persisted(counters, b"\x00", L3Place("lmdb", "/s"), TierStats(capacity=8))
    assert stats.store is not None and stats.store.tiers["L1"] == TierStats(inserts=2)
    assert set(stats.store.tiers) == {"L1", "L3"} and not stats.store.links
    assert stats.totals is None and stats.last_run is None
    assert EngineTotals.from_dict({"requests": 2, "sources": {"L1": 3, "L2": "y"}, "wait_s": None}) == EngineTotals(
        requests=2, sources={"L1": 3}
    )
