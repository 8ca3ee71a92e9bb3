"""Which page follows which among L1's and L2's pages (tiers/lineage.py): the share of
held pages whose previous page is gone, counted at each page that leaves."""

import pytest

from kvtier.tiers.lineage import Lineage
from kvtier.tiers.page import Namespace, page_keys
from kvtier.tiers.residency import Change

KEYS = page_keys(Namespace("lineage-test", "float16", 4), list(range(16)))  # a chain of 4 pages


def test_unreachable_share_counts_held_pages_whose_previous_page_neither_tier_holds():
    lineage = Lineage()
    lineage.learn(KEYS[:2])
    lineage.changed(Change("L1", KEYS[0], True))
    lineage.changed(Change("L2", KEYS[1], True))
    lineage.changed(Change("L1", KEYS[0], False))  # on its way to L2, held: 0 of 2 unreachable
    lineage.changed(Change("L2", KEYS[0], True))
    lineage.changed(Change("L2", KEYS[0], False))  # gone: page 1's previous page too, 1 of 1
    assert lineage.unreachable_share() == pytest.approx(0.5)
    assert lineage.orphans == 1


def test_a_chain_learned_late_links_pages_already_held():
    lineage = Lineage()
    lineage.arrives(KEYS[0], None)
    lineage.arrives(KEYS[1], None)  # published without its parent: taken for a first page
    for key in KEYS[:2]:
        lineage.changed(Change("L2", key, True))
    lineage.learn(KEYS[:3])  # a restore's chain shows page 1 follows page 0
    lineage.changed(Change("L2", KEYS[0], False))
    assert lineage.unreachable_share() == 1.0
