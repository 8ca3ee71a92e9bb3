"""Holds (``engine.serve.holds``): store pins with a deadline, under a cap."""

from __future__ import annotations

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
    assert set(engine.store.view().pins) == set(keys[:3])
    now[0] = 200.0
    assert holds.hold("cache_control", keys, 300.0) == 3  # renewed: due at 500 now
    now[0] = 400.0
    holds.sweep()
    assert holds.pages() == 3 and set(engine.store.view().pins) == set(keys[:3])
    now[0] = 500.0
    holds.sweep()
    assert holds.pages() == 0 and not engine.store.view().pins
    engine.close()
