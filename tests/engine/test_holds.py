"""Holds (``engine.serve.holds``): store pins with a deadline, under a cap."""

from __future__ import annotations

import threading
import time

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.engine.serve.holds import Holds
from kvtier.tiers.hierarchy import StoreConfig

from .tiny import tiny_model

PAGE = 16


def test_a_hold_is_capped_renewed_and_released_when_its_time_is_up():
    engine = Engine(tiny_model(), EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None)))
    (request,) = engine.generate(["a prompt of several pages " * 4], SamplingParams(max_tokens=1))
    keys = request.keys
    assert len(keys) >= 5
    now = [0.0]
    holds = Holds(engine.store, limit=3, clock=lambda: now[0])
    assert holds.hold("cache_control", keys, 300.0) == 3  # cut short at the cap, never forced
    assert set(engine.store.accounts.view().pins) == set(keys[:3])
    now[0] = 200.0
    assert holds.hold("cache_control", keys, 300.0) == 3  # renewed: due at 500 now
    now[0] = 400.0
    holds.sweep()
    assert holds.pages() == 3 and set(engine.store.accounts.view().pins) == set(keys[:3])
    now[0] = 500.0
    holds.sweep()
    assert holds.pages() == 0 and not engine.store.accounts.view().pins
    engine.close()


def test_expired_holds_are_released_with_no_traffic():
    engine = Engine(tiny_model(), EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None)))
    (request,) = engine.generate(["a prompt of several pages " * 4], SamplingParams(max_tokens=1))
    now, stop = [0.0], threading.Event()
    holds = Holds(engine.store, limit=8, clock=lambda: now[0])
    assert holds.hold("tool_wait", request.keys, 10.0) == len(request.keys)
    holds.sweep_every(0.01, stop)
    try:
        time.sleep(0.1)
        assert holds.pages() == len(request.keys)  # not due yet
        now[0] = 10.0
        deadline = time.monotonic() + 5
        while holds.pages() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert holds.pages() == 0 and not engine.store.accounts.view().pins
    finally:
        stop.set()
        engine.close()


def test_a_tool_wait_that_does_not_fit_releases_older_tool_waits_never_cache_control():
    engine = Engine(tiny_model(), EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None)))
    prompts = [f"conversation {i} has a prompt of several pages " * 3 for i in range(3)]
    first, second, third = engine.generate(prompts, SamplingParams(max_tokens=1))
    assert min(len(r.keys) for r in (first, second, third)) >= 3
    holds = Holds(engine.store, limit=3, clock=lambda: 0.0)
    pins = lambda: set(engine.store.accounts.view().pins)  # noqa: E731
    assert holds.hold("cache_control", first.keys[:1], 300.0) == 1
    assert holds.hold("tool_wait", second.keys[:2], 120.0) == 2
    assert holds.hold("tool_wait", third.keys[:2], 120.0) == 2  # the older tool wait gave way
    assert pins() == {first.keys[0], *third.keys[:2]}
    assert holds.hold("tool_wait", second.keys[:3], 120.0) == 2  # never the client's cache_control
    assert pins() == {first.keys[0], *second.keys[:2]} and holds.pages() == 3
    engine.close()
