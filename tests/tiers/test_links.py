"""Link names are typed (``Link``) yet read as the plain strings that counters, JSON,
msgpack and Prometheus labels carry."""

from __future__ import annotations

import json

import msgpack

from kvtier.tiers.counters import LinkStats
from kvtier.tiers.links import Link, LinkLedger


def test_a_link_is_its_name_in_lookups_and_in_every_encoding():
    ledger = LinkLedger()
    ledger.record(Link.L2_L1, 100, 0.5)
    stats = ledger.stats()
    assert stats["L2->L1"] == LinkStats(bytes=100, pages=1, seconds=0.5)  # a literal reads an enum-keyed dict
    assert {"L2->L1": 7}[Link.L2_L1] == 7  # and a member reads a dict a store persisted
    shape = {link: counters.to_json() for link, counters in stats.items()}
    assert shape["L2->L1"] == {"bytes": 100, "pages": 1, "seconds": 0.5}
    names = {"L3->L1", "L3->L2", "L2->L1", "L1->L2", "L2->L3", "L1->L3"}
    assert set(json.loads(json.dumps(shape))) == names
    assert set(msgpack.unpackb(msgpack.packb(shape))) == names
    assert f"{Link.L3_L2} {Link.L1_L3}" == "L3->L2 L1->L3" and str(Link.L2_L1) == "L2->L1"
