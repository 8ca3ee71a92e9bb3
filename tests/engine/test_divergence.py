"""Where a prompt left the cache, as ``Engine.result`` (``run --json``) reports it."""

from __future__ import annotations

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from .tiny import tiny_model

PAGE = 16


def test_the_report_points_at_the_first_changed_token_with_its_own_text():
    loaded = tiny_model()
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None)))
    first = "the system prompt of an agent, " * 6 + "and its first question"
    changed_at = 100
    second = first[:changed_at] + "#" + first[changed_at + 1 :]
    params = SamplingParams(max_tokens=2)
    (one,) = engine.generate([first], params)
    (two,) = engine.generate([second], params)
    report = engine.result(two)["divergence"]
    assert engine.result(one)["divergence"]["token"] == 0  # nothing stored yet
    assert changed_at - PAGE < report["token"] <= changed_at
    assert report["prompt_tokens"] == len(second)
    assert report["before"] == second[report["token"] - 8 : report["token"]]
    assert report["after"] == second[report["token"] : report["token"] + 8]
    (three,) = engine.generate([second], params)
    assert engine.result(three)["divergence"]["token"] >= len(second) - PAGE  # all but the last page
    engine.close()
