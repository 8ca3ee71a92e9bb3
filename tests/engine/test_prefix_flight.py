"""Prefix single flight (engine/prefix_flights.py, costmodel.plan.plan_wait): a prefix
shared inside a burst is computed once; waiting never deadlocks; distinct prompts
are not held. The tiny model keeps these fast; its own greedy loop is the oracle."""

import dataclasses

import pytest

from kvtier.costmodel.models import ComputeModel
from kvtier.costmodel.plan import Profile, plan_wait
from kvtier.engine.admission import hold_deadline
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.page import Source

from .test_engine import CountingModel
from .test_lifecycle import assert_clean
from .tiny import greedy, tiny_model

PAGE = 16
PREFIX_PAGES = 8
PREFIX = [(i * 7) % 200 + 32 for i in range(PREFIX_PAGES * PAGE)]
SUFFIX = 12
GREEDY = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def prompt(n: int) -> list[int]:
    """The shared prefix, then a suffix of its own."""
    return PREFIX + [(n * 13 + i * 5) % 200 + 32 for i in range(SUFFIX)]


class PrefillCounting(CountingModel):
    """The model, counting the prompt tokens it is run over (decode steps run one token each)."""

    def __call__(self, inputs, *args, **kwargs):
        self.tokens += inputs.size if inputs.shape[1] > 1 else 0
        return self.model(inputs, *args, **kwargs)


def make_engine(loaded, **config) -> tuple[Engine, PrefillCounting]:
    """An engine publishing after every page of prefill, whose cost model predicts a slow
    prefill (1 s a token) and is not refined: its deadlines never pass in a test."""
    counting = PrefillCounting(loaded.model)
    store = StoreConfig(l1_bytes=1 << 30, l2_bytes=1 << 30)
    config = {"single_flight": "prefix", "prefill_step_size": PAGE, **config}
    engine = Engine(dataclasses.replace(loaded, model=counting), EngineConfig(page_size=PAGE, store=store, **config))
    engine.profile = Profile(Profile.defaults().links, ComputeModel([0.0, 1.0, 0.0]))
    engine.profile.compute.observe = lambda *args, **kwargs: None
    return engine, counting


def run(engine: Engine, steps: int = 400) -> None:
    """``engine.run()``, failing instead of hanging if requests are left waiting."""
    for _ in range(steps):
        if not ((view := engine.view()).pending or view.running):
            return
        engine.step()
    pytest.fail(f"{engine.view().pending} requests still waiting after {steps} steps")


def assert_no_flight_left(engine: Engine) -> None:
    assert_clean(engine)
    prefix = engine.view().prefix
    assert not (prefix.in_flight or prefix.leaders or prefix.waiting)


def test_a_burst_sharing_a_prefix_computes_it_once(loaded):
    """Six prompts, one shared prefix: one leads, five wait for its pages and restore
    them from L1; outputs are exact, labels say L1, the wait is reported."""
    prompts = [prompt(n) for n in range(6)]
    engine, counting = make_engine(loaded)
    requests = [engine.submit(p, GREEDY) for p in prompts]
    engine.step()
    view = engine.view()
    assert len(view.running) == 1 and len(view.prefix.waiting) == 5, "one leader, five held"
    run(engine)
    assert counting.tokens <= len(PREFIX) + 6 * (SUFFIX + PAGE)
    for r, p in zip(requests, prompts):
        assert r.output == greedy(loaded, p, GREEDY.max_tokens)
    leader, followers = requests[0], requests[1:]
    assert leader.sources()["recomputed"] == len(prompts[0]) and leader.waited_tokens == 0
    for r in followers:
        assert r.sources() == {**r.sources(), "L1": len(PREFIX), "recomputed": SUFFIX}
        assert engine.result(r)["waited_tokens"] == len(PREFIX) and r.wait_s > 0
    totals = engine.stats().totals
    assert totals.waited_tokens == 5 * len(PREFIX)
    assert totals.wait_s == pytest.approx(sum(r.wait_s for r in followers))
    assert_no_flight_left(engine)


@pytest.mark.parametrize("how", ["cancelled", "failed"])
def test_a_leader_ending_mid_prefill_releases_its_followers(loaded, how):
    """The leader ends after publishing a few pages: its followers plan again (one
    leads, restoring what was published), and every one of them finishes exactly."""
    prompts = [prompt(n) for n in range(3)]
    engine, _ = make_engine(loaded)
    if how == "failed":
        publish, calls = engine.publisher.publish, []

        def third_fails(request, caches, ready):
            calls.append(request.rid)
            if request.prompt == prompts[0] and calls.count(request.rid) == 3:
                raise RuntimeError("injected fault")
            publish(request, caches, ready)

        engine.publisher.publish = third_fails
    requests = [engine.submit(p, GREEDY) for p in prompts]
    for _ in range(2):
        engine.step()
    leader = requests[0]
    assert 0 < leader.published < PREFIX_PAGES and len(engine.view().prefix.waiting) == 2
    if how == "cancelled":
        leader.cancel()
    run(engine)
    assert leader.finish_reason == ("cancelled" if how == "cancelled" else "error")
    for r, p in zip(requests[1:], prompts[1:]):
        assert r.finish_reason == "length" and r.output == greedy(loaded, p, GREEDY.max_tokens)
    assert requests[1].sources()["L1"] >= 2 * PAGE, "the new leader restores what the old one published"
    assert requests[2].sources()["L1"] == len(PREFIX), "the other waits for the new leader"
    assert_no_flight_left(engine)


def test_a_later_arrival_reuses_what_is_published_and_waits_for_the_rest(loaded):
    first, second = prompt(0), prompt(1)
    engine, counting = make_engine(loaded)
    a = engine.submit(first, GREEDY)
    while a.published < PREFIX_PAGES // 2:
        engine.step()
    published = a.published
    b = engine.submit(second, GREEDY)
    before = counting.tokens
    run(engine)
    assert counting.tokens - before <= (len(first) - published * PAGE) + SUFFIX + PAGE
    assert b.sources()["L1"] == len(PREFIX) and b.waited_tokens == (PREFIX_PAGES - published) * PAGE
    assert b.output == greedy(loaded, second, GREEDY.max_tokens)
    assert_no_flight_left(engine)


def test_distinct_prompts_are_not_held(loaded):
    prompts = [[(n * 41 + i * 3) % 200 + 32 for i in range(4 * PAGE)] for n in range(4)]
    engine, _ = make_engine(loaded)
    requests = [engine.submit(p, GREEDY) for p in prompts]
    engine.step()
    view = engine.view()
    assert len(view.running) == 4 and len(view.prefix.waiting) == 0
    run(engine)
    assert all(
        r.waited_tokens == 0 and r.output == greedy(loaded, p, GREEDY.max_tokens) for r, p in zip(requests, prompts)
    )


def test_a_waiter_is_released_at_its_deadline_and_does_not_wait_again(loaded):
    """A cost model that predicts the leader done in nanoseconds gives its followers a
    deadline that has passed by the next step: they are released then, plan again
    without waiting, and compute beside the leader, exactly."""
    prompts = [prompt(n) for n in range(3)]
    engine, _ = make_engine(loaded)
    engine.profile = Profile(Profile.defaults().links, ComputeModel([0.0, 1e-9, 0.0]))
    requests = [engine.submit(p, GREEDY) for p in prompts]
    engine.step()
    assert len(engine.view().prefix.waiting) == 2
    engine.step()
    view = engine.view()
    assert len(view.prefix.waiting) == 0 and len(view.running) == 3
    assert requests[0].published < PREFIX_PAGES, "released before the leader published its prefix"
    run(engine)
    for r, p in zip(requests, prompts):
        assert r.output == greedy(loaded, p, GREEDY.max_tokens)
    assert [r.waited_tokens for r in requests] == [0, len(PREFIX), len(PREFIX)]
    assert_no_flight_left(engine)


def test_a_held_requests_deadline_is_set_at_its_first_hold_and_never_extended():
    """A later hold may shorten the deadline, never move it later: a request waits a
    bounded time however often its leader changes."""
    first = hold_deadline(10.0, 5.0, None)
    assert first == 15.0
    assert hold_deadline(12.0, 5.0, first) == first, "a later hold allowing as long: not extended"
    assert hold_deadline(11.0, 1.0, first) == 12.0, "a later hold allowing less: shortened"


def test_a_follower_held_again_behind_a_new_leader_keeps_its_first_deadline(loaded):
    """The leader is cancelled; one follower leads in its place and the other is held
    again behind it, under a cost model that now allows waiting ten times longer: its
    deadline stays the one of its first hold. Outputs stay exact."""
    prompts = [prompt(n) for n in range(3)]
    engine, _ = make_engine(loaded)
    requests = [engine.submit(p, GREEDY) for p in prompts]
    engine.step()
    leader, first_follower, follower = requests
    first = follower.wait_deadline
    assert first is not None and engine.view().prefix.waiting[follower.rid].deadline == first
    engine.profile = Profile(Profile.defaults().links, ComputeModel([0.0, 10.0, 0.0]))
    engine.profile.compute.observe = lambda *args, **kwargs: None
    leader.cancel()
    engine.step()  # the leader ends, its followers go back to the queue
    engine.step()  # admitted again: one leads, the other is held behind it
    held = engine.view().prefix.waiting[follower.rid]
    assert held.leader == first_follower.rid, "held again, behind the new leader"
    assert follower.wait_deadline == held.deadline == first
    run(engine)
    for r, p in zip(requests[1:], prompts[1:]):
        assert r.output == greedy(loaded, p, GREEDY.max_tokens)
    assert_no_flight_left(engine)


def test_wait_plan_weighs_the_leaders_progress_and_sets_a_deadline():
    """Waiting for pages costs the leader's remaining work; computing them beside it
    costs this request's own work and the leader's share. The deadline is the time at
    which computing now would have ended, less what remains after the wait."""
    profile = Profile(Profile.defaults().links, ComputeModel([0.0, 1.0, 0.0]))  # 1 s a token
    plan = plan_wait([], 8, 0, 8 * PAGE + 4, PAGE, 1024, profile)
    assert plan.wait and plan.wait_s == pytest.approx(8 * PAGE)
    assert plan.recompute_s == pytest.approx((8 * PAGE + 4) + 8 * PAGE)  # its own, and the leader's share
    assert plan.deadline_s == pytest.approx(plan.recompute_s - 4)
    nearly = plan_wait([Source.L1] * 7, 1, 7 * PAGE, 8 * PAGE + 4, PAGE, 1024, profile)
    assert nearly.wait and nearly.wait_s == pytest.approx(PAGE)
    far_behind = plan_wait([Source.L1] * 7, 1, 0, 8 * PAGE + 4, PAGE, 1024, profile)
    assert not far_behind.wait, "one page that the leader reaches only after 7 more: compute it now"


def test_prefix_flights_release_each_waiter_once_and_leave_nothing():
    """The bookkeeping alone: a run of keys in flight stops at another leader's key; a
    waiter goes when its last awaited key is published (not before), a withdrawn one
    never; a leader's end releases the rest; nothing remains."""
    from kvtier.engine.prefix_flights import PrefixFlights

    flights = PrefixFlights()
    flights.computing(1, ["a", "b", "c"])
    flights.computing(2, ["b", "c", "d"])  # b and c are already 1's: 2 computes only d
    assert flights.in_flight(["a", "b", "c", "d"], 0) == (1, 3)
    assert flights.in_flight(["a", "b", "c", "d"], 3) == (2, 1)
    assert flights.in_flight(["x"], 0) == (None, 0)
    flights.hold(10, 1, "b", deadline=float("inf"))
    flights.hold(11, 1, "c", deadline=float("inf"))
    flights.hold(12, 1, "c", deadline=float("inf"))
    flights.withdraw(12)
    assert flights.published(1, ["a"]) == []
    assert flights.published(1, ["b"]) == [10]
    assert flights.expired(0.0) == []
    assert flights.ended(1) == [11] and flights.ended(1) == []
    assert flights.ended(2) == []
    view = flights.view()
    assert not (view.in_flight or view.leaders or view.waiting)
