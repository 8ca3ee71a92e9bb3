"""Records are bound to their keys (issue 25, item 1), on LMDB and on Redis: a record put
under another page's key is never served, whatever else in it is right.

Two prefixes end in the same page tokens (``SHARED``): the record of one, or a record
forged with a right checksum over the other's bytes, put under the other's key passes the
namespace, token and checksum checks; only the key in its header tells it apart.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest
from xxhash import xxh3_64_intdigest

from kvtier.tiers.l3.record import RECORD_VERSION, RecordHeader, token_bytes
from kvtier.tiers.page import Source, page_keys
from kvtier.tiers.tier import kv_to_host

from ..redis_servers import needs_redis, redis_server  # noqa: F401
from .lmdb_files import raw_env
from .small_pages import KV, NS, PAGE, joined, make_store, same_bytes

SHARED = [7, 7, 7, 7]  # the second page of both prefixes
A = [1, 2, 3, 4, *SHARED]
B = [5, 6, 7, 8, *SHARED]
KEYS_A, KEYS_B = page_keys(NS, A), page_keys(NS, B)


@contextmanager
def records(location: str | Path) -> Iterator[dict]:
    """The stored records as a dict-like view (key -> value), read and written as any
    other client of the store would (the tiers closed)."""
    if isinstance(location, Path):
        with raw_env(location) as (env, pages, _), env.begin(write=True, db=pages) as txn:
            yield _Records(lambda k: txn.get(k), lambda k, v: txn.put(k, v))
    else:
        import redis

        client = redis.Redis.from_url(location)
        yield _Records(lambda k: client.get(b"kvtier:p:" + k), lambda k, v: client.set(b"kvtier:p:" + k, v))
        client.close()


class _Records:
    def __init__(self, get, put) -> None:
        self.get, self.put = get, put

    def __getitem__(self, key: bytes) -> bytes:
        return bytes(self.get(key))

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.put(key, value)


@pytest.fixture(params=["lmdb", pytest.param("redis", marks=[pytest.mark.slow, needs_redis])])
def location(request, tmp_path) -> str | Path:
    """A store holding both prefixes' pages (A: KV 0, 1; B: KV 2, 3), in L3 only."""
    where = tmp_path / "store" if request.param == "lmdb" else request.getfixturevalue("redis_server").url
    store = make_store(0, 0, where)
    for keys, tokens, first in ((KEYS_A, A, 0), (KEYS_B, B, 2)):
        for i, key in enumerate(keys):
            store.publish(key, tokens[4 * i : 4 * i + 4], KV[first + i])
    store.close()
    return where


def forged(key: bytes, data: bytes, tokens: bytes = token_bytes(SHARED), namespace: bytes = NS.digest()) -> bytes:
    """A raw record of ``data`` (by default: as the shared page) whose header says ``key``,
    its checksum right."""
    header = RecordHeader(RECORD_VERSION, key, namespace, tokens, "raw", len(data), xxh3_64_intdigest(data))
    return header.pack() + data


def version_1(data: bytes) -> bytes:
    """The shared page as kvtier wrote it before records carried their key."""
    fields = {"v": 1, "ns": NS.digest(), "tok": token_bytes(SHARED), "codec": "raw", "n": len(data)}
    head = msgpack.packb({**fields, "xxh": xxh3_64_intdigest(data)})
    return len(head).to_bytes(4, "little") + head + data


BAD = {
    "swapped": lambda stored: stored[KEYS_B[1]],  # B's own record of the shared page
    "forged": lambda stored: forged(bytes(16), kv_to_host(KV[3]).tobytes()),
    "version 1": lambda stored: version_1(kv_to_host(KV[1]).tobytes()),  # A's own bytes, but no key
}
REASON = {"swapped": "page key differs", "forged": "page key differs", "version 1": "format version differs"}


@pytest.mark.parametrize("bad", BAD)
def test_a_record_under_another_key_is_never_restored(location, bad, caplog):
    with records(location) as stored:
        stored[KEYS_A[1]] = BAD[bad](stored)
    store = make_store(0, 2, location)
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.l3.check"):
        restored = store.restore(KEYS_A, A)
    assert restored.sources == [Source.L3]  # the run stops at the bad record: recomputed from there
    assert same_bytes(joined(restored), KV[0])
    store.release(restored.keys)
    store.settle()
    assert store.disk.counters.checksum_failures == 1 and REASON[bad] in caplog.text
    assert not store.disk.contains(KEYS_A[1])  # deleted (it was unchanged)
    assert store.restore(KEYS_B, B).sources == [Source.L3] * 2  # the other prefix is untouched
    store.close()


@pytest.mark.parametrize("bad", BAD)
def test_a_single_read_of_a_record_under_another_key_is_a_miss(location, bad):
    with records(location) as stored:
        stored[KEYS_A[1]] = BAD[bad](stored)
    store = make_store(0, 0, location)
    assert store.disk.get(KEYS_A[1], NS.digest(), SHARED, PAGE) is None
    assert store.disk.counters.checksum_failures == 1 and store.disk.counters.hit_pages == 0
    got = store.disk.get(KEYS_B[1], NS.digest(), SHARED, PAGE)
    assert got is not None and bytes(got[0]) == kv_to_host(KV[3]).tobytes()
    store.close()
