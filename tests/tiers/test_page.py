import subprocess
import sys
from dataclasses import replace

import pytest

from kvtier.tiers.page import ChainRoot, Namespace, PageGeometry, key_chain, page_keys, reusable_pages

NS = Namespace("fingerprint", "bfloat16", 4)


def test_only_full_pages_are_keyed():
    assert len(page_keys(NS, list(range(11)))) == 2
    assert len(page_keys(NS, list(range(12)))) == 3
    assert page_keys(NS, [1, 2, 3]) == []


def test_keys_chain_the_whole_prefix():
    a = page_keys(NS, list(range(12)))
    b = page_keys(NS, [99] + list(range(1, 12)))
    assert all(x != y for x, y in zip(a, b)), "changing page 0 must change every later key"
    c = page_keys(NS, list(range(8)) + [7, 7, 7, 7])
    assert a[:2] == c[:2] and a[2] != c[2]


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_fingerprint", "other"),
        ("kv_dtype", "float32"),
        ("page_size", 4),
        ("layout_version", 2),
        ("adapter_id", "lora-1"),
        ("cache_salt", "tenant-b"),
    ],
)
def test_every_namespace_field_changes_keys(field, value):
    other = replace(NS, **{field: value})
    if other == NS:  # page_size 4 equals NS; use a different one
        other = replace(NS, page_size=8)
    tokens = list(range(16))
    assert set(page_keys(NS, tokens)).isdisjoint(page_keys(other, tokens))


def test_the_implicit_tenant_keeps_the_plain_chain():
    """Without a root of its own a sequence is keyed as before tenants: stores stay valid."""
    tokens = list(range(14))
    chain = key_chain(NS, tokens)
    assert chain.keys == page_keys(NS, tokens) and chain.parents == [NS.digest(), *chain.keys]
    assert key_chain(NS, tokens, ChainRoot(NS.digest(), shared_pages=2)) == chain


def test_a_callers_root_keys_every_page_but_the_shared_ones():
    tokens = list(range(18))  # 4 full pages, 2 tokens after them
    plain = key_chain(NS, tokens)
    alice, bob = (key_chain(NS, tokens, ChainRoot(own, shared_pages=2)) for own in (b"a" * 32, b"b" * 32))
    assert alice.keys[:2] == bob.keys[:2] == plain.keys[:2]  # the declared prefix: everyone's
    assert {*alice.keys[2:]}.isdisjoint({*bob.keys[2:], *plain.keys})  # past it: hers alone
    assert alice.parents[2] not in (bob.parents[2], alice.keys[1])  # her root is mixed in there
    assert set(key_chain(NS, tokens, ChainRoot(b"a" * 32)).keys).isdisjoint(plain.keys)
    assert alice.parents[4] != bob.parents[4]  # the partial page after them is hers too
    exactly = key_chain(NS, tokens[:9], ChainRoot(b"a" * 32, shared_pages=2))  # 2 pages, then a partial one
    assert exactly.keys == plain.keys[:2] and exactly.parents[2] == alice.parents[2]


def test_keys_are_stable_across_processes():
    code = (
        "import kvtier; from kvtier.tiers.page import Namespace, page_keys;"
        "print(page_keys(Namespace('fingerprint','bfloat16',4), list(range(8)))[1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == page_keys(NS, list(range(8)))[1].hex()


def test_last_token_is_never_reused():
    assert reusable_pages(8, 4) == 1
    assert reusable_pages(9, 4) == 2
    assert reusable_pages(1, 4) == 0


def test_geometry_bytes():
    g = PageGeometry(24, 2, 64, 128, "bfloat16")
    assert g.bytes_per_token == 24 * 2 * 2 * 64 * 2 == 12288
    assert g.nbytes == 128 * 12288
