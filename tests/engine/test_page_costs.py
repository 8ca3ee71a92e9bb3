"""The engine weighs each page it publishes by its recompute at its depth (the fitted
prefill model, ``ComputeModel.page_seconds``), and the ``cost`` policy keeps by that."""

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from .conftest import text_prompt

PAGE = 64


def test_a_deep_page_outlives_a_shallow_one_of_equal_use(loaded):
    """L1 holds four pages, nothing below it. A three-page prompt, then a one-page one:
    each page used once (published). A fifth page needs room: with every page costing
    the same, GreedyDual takes the oldest page nothing needs (leaf-first keeps the
    three-page prompt's first two for its third), the deep third page; weighed by depth
    (attention over the pages before it), the shallow one-page prompt leaves instead."""
    page_bytes = loaded.geometry(PAGE).nbytes
    store = StoreConfig(l1_bytes=4 * page_bytes, l2_bytes=0, l3_bytes=0, store_dir=None)
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store, policy="cost"))
    engine.profile.compute.coef = [0.0, 1e-6, 1e-6]  # a page at depth p costs c1*n + c2*n*(p + n/2)
    deep, shallow, newcomer = (text_prompt(loaded, n * PAGE, seed=n) for n in (3, 1, 2))
    once = SamplingParams(max_tokens=1)
    engine.generate([deep], once)
    engine.generate([shallow], once)
    engine.generate([newcomer[:PAGE]], once)  # one page more than L1 holds
    (deep_again,) = engine.generate([deep], once)
    (shallow_again,) = engine.generate([shallow], once)
    engine.close()
    assert deep_again.sources()["L1"] == 3 * PAGE - 1  # all three pages kept (the last token is computed)
    assert shallow_again.sources()["recomputed"] == PAGE
    assert engine.store is not None and engine.store.stats().tiers["L1"].evictions >= 1


def test_pages_priced_under_a_slower_fit_do_not_outlive_newer_ones(loaded):
    """The fit moves as prefill is observed (the first, cold prefills look slow). A
    prompt published under a fit ten times slower, then another under today's: with
    pages priced in seconds the old prompt's would outlive the new one's, which a
    newcomer then evicts; priced relative to a first page, the older prompt leaves."""
    page_bytes = loaded.geometry(PAGE).nbytes
    store = StoreConfig(l1_bytes=4 * page_bytes, l2_bytes=0, l3_bytes=0, store_dir=None)
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store, policy="cost"))
    old, new, newcomer = (text_prompt(loaded, 2 * PAGE, seed=n) for n in (4, 5, 6))
    once = SamplingParams(max_tokens=1)
    engine.profile.compute.coef = [0.0, 1e-5, 1e-6]
    engine.generate([old], once)
    engine.profile.compute.coef = [0.0, 1e-6, 1e-7]
    engine.generate([new], once)
    engine.generate([newcomer[:PAGE]], once)  # needs room for one page: one prompt's leaf goes
    (new_again,) = engine.generate([new], once)
    engine.close()
    assert new_again.sources()["L1"] == 2 * PAGE - 1  # both its pages kept (the last token is computed)
