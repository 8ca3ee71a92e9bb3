"""Prefix single flight on a recurrent hybrid (generated lfm2): a follower held for a
prefix that its leader is computing restores at the end of the shared prefix, because
the leader keeps a snapshot there (its prefill is cut at that page), not only at its own
snapshot points. Greedy outputs equal mlx-lm's; labels are exact."""

from __future__ import annotations

import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from .conftest import mlx_lm_greedy, text_prompt
from .kind_models import restoring_wins
from .test_hybrid_models import lfm2 as lfm2  # the module-scoped generated model

PAGE = 16
SPACING = 4  # the leader's own snapshots: after pages 4 and 8 (its last full page)
SHARED_PAGES = 5  # the shared prefix ends between them
GREEDY = SamplingParams(max_tokens=6)


@pytest.mark.parametrize("leader_steps", [0, 2])  # the follower arrives with the leader, or mid-prefill
def test_a_follower_restores_at_the_end_of_the_prefix_shared_in_flight(lfm2, leader_steps):
    shared = text_prompt(lfm2, SHARED_PAGES * PAGE, seed=21)
    leader_prompt = shared + text_prompt(lfm2, 60, seed=22)  # 140 tokens: 8 full pages
    follower_prompt = shared + text_prompt(lfm2, 30, seed=23)  # 110 tokens: 6 full pages
    store = StoreConfig(l1_bytes=1 << 26, l2_bytes=1 << 26, snapshot_l1_bytes=1 << 20)
    config = EngineConfig(
        page_size=PAGE, store=store, prefill_step_size=PAGE, snapshot_spacing=SPACING, single_flight="prefix"
    )
    engine = restoring_wins(Engine(lfm2, config))
    leader = engine.submit(leader_prompt, GREEDY)
    for _ in range(leader_steps):
        engine.step()
    assert leader.published == leader_steps  # one page a step: the shared prefix is still in flight
    follower = engine.submit(follower_prompt, GREEDY)
    engine.step()
    assert follower.rid in engine.view().prefix.waiting, "held for the leader's pages"
    engine.run()
    kept = engine.store.accounts.view().snapshots[0].pages
    engine.close()
    assert leader.output == mlx_lm_greedy(lfm2, leader_prompt, GREEDY.max_tokens)
    assert follower.output == mlx_lm_greedy(lfm2, follower_prompt, GREEDY.max_tokens)
    assert leader.sources()["recomputed"] == len(leader_prompt)
    assert leader.prefilled == len(leader_prompt), "counted across its insertions into mlx-lm"
    shared_tokens = SHARED_PAGES * PAGE
    assert follower.sources() == {"L1": shared_tokens, "L2": 0, "L3": 0, "recomputed": 110 - shared_tokens}
    assert follower.waited_tokens == shared_tokens - leader_steps * PAGE
    assert kept == 4  # the leader's after pages 4, 5 (the shared end) and 8; the follower's after page 6
