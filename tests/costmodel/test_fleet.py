"""The fleet's placement rule: least predicted TTFT under a bounded load imbalance."""

import pytest

from kvtier.costmodel.fleet import Candidate, Reason, choose
from kvtier.costmodel.models import ComputeModel, LinkModel
from kvtier.costmodel.profile import Profile
from kvtier.tiers.page import Source

PAGE, PAGE_BYTES, PROMPT = 16, 1 << 16, 160  # 10 pages


def profile(l3_bytes_per_s: float = 1e9) -> Profile:
    links = dict(Profile.defaults().links)
    links["L3->L1"] = LinkModel.of(1e-4, l3_bytes_per_s)
    links["L2->L1"] = LinkModel.of(1e-4, 1e10)
    return Profile(links, ComputeModel([0.0, 1e-3, 0.0]))  # 1 ms a token


def backend(name: str, matched: str = "", pending: int = 0, load: int = 0, **kw: float) -> Candidate:
    sources = tuple(Source(s) for s in matched.split()) if matched else ()
    return Candidate(name, sources, pending, load, profile(**kw))


def test_the_backend_holding_the_prefix_wins() -> None:
    placed = choose([backend("a"), backend("b", "L1 " * 8), backend("c", "L3 " * 8)], PROMPT, PAGE, PAGE_BYTES, 4)
    assert placed.backend == "b" and placed.reason is Reason.FASTEST
    seconds = {e.name: e.predicted_s for e in placed.estimates}
    assert seconds["b"] < seconds["c"] < seconds["a"]


def test_a_queue_outweighs_a_held_prefix() -> None:
    # b holds 8 of 10 pages but 1,000 tokens wait there: computing the prompt elsewhere is sooner
    placed = choose([backend("a"), backend("b", "L1 " * 8, pending=1000, load=1)], PROMPT, PAGE, PAGE_BYTES, 4)
    assert placed.backend == "a"
    assert placed.chosen.queue_s == 0.0


def test_a_slow_link_to_the_shared_store_is_priced() -> None:
    fast, slow = backend("fast", "L3 " * 8), backend("slow", "L3 " * 8, l3_bytes_per_s=1e5)
    assert choose([slow, fast], PROMPT, PAGE, PAGE_BYTES, 4).backend == "fast"


def test_a_backend_over_the_load_bound_is_skipped() -> None:
    hot = backend("hot", "L1 " * 8, load=5)
    cold = backend("cold", load=0)
    assert choose([hot, cold], PROMPT, PAGE, PAGE_BYTES, 5).backend == "hot"
    placed = choose([hot, cold], PROMPT, PAGE, PAGE_BYTES, 4)
    assert placed.backend == "cold" and placed.reason is Reason.BALANCED
    assert [e.eligible for e in placed.estimates] == [False, True]


def test_ties_go_to_the_least_loaded() -> None:
    assert choose([backend("a", load=2), backend("b", load=1)], PROMPT, PAGE, PAGE_BYTES, 4).backend == "b"


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        choose([], PROMPT, PAGE, PAGE_BYTES, 1)
    with pytest.raises(ValueError):
        choose([backend("a")], PROMPT, PAGE, PAGE_BYTES, -1)
