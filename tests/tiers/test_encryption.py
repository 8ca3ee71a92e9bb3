"""Encryption at rest (issue 25, item 4), on LMDB and on Redis: encrypted records restore
byte for byte with either codec, hold no token ids in the clear, and are never served
when anything in them is changed, to a reader without the key, or with another key; an
encrypted store serves no plain record (which anyone who can write the store could forge).
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace

import mlx.core as mx
import pytest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.l3.cipher import RecordCipher
from kvtier.tiers.l3.open import open_l3
from kvtier.tiers.l3.record import RecordHeader, token_bytes
from kvtier.tiers.l3.secret import derive
from kvtier.tiers.page import Source, page_keys
from kvtier.tiers.tier import kv_to_host

from ..redis_servers import needs_redis, redis_server  # noqa: F401
from .small_pages import GEOMETRY, KV, NS, PAGE, SMALL, TOKENS, joined, same_bytes
from .test_bound_records import records

SECRET = os.urandom(32)


def cipher(secret: bytes = SECRET) -> RecordCipher:
    return RecordCipher(functools.partial(derive, secret, b"encrypt"), derive(secret, b"encrypt-id")[:8].hex())


SEALED = replace(NS, encryption=cipher().name)
KEYS = page_keys(SEALED, TOKENS)


def sealed_store(location, l2_pages: int = 0, codec: str = "raw", secret: bytes = SECRET) -> TieredStore:
    config = StoreConfig(0, l2_pages * PAGE, 256 * PAGE, location, codec, cipher=cipher(secret))
    return TieredStore(GEOMETRY, SEALED, config)


@pytest.fixture(params=["lmdb", pytest.param("redis", marks=[pytest.mark.slow, needs_redis])])
def location(request, tmp_path):
    return tmp_path / "store" if request.param == "lmdb" else request.getfixturevalue("redis_server").url


def fill(location, data=KV, codec: str = "raw") -> None:
    store = sealed_store(location, codec=codec)
    for i in range(3):
        store.publish(KEYS[i], TOKENS[4 * i : 4 * i + 4], data[i])
    store.close()


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_encrypted_pages_restore_byte_for_byte_and_hide_their_tokens(location, codec):
    data = SMALL if codec == "zstd" else KV  # pages that compress: the zstd path is taken
    fill(location, data, codec)
    with records(location) as stored:
        for i in range(3):
            value = stored[KEYS[i]]
            assert RecordHeader.unpack(memoryview(value))[0].nonce  # encrypted, whatever the codec
            assert token_bytes(TOKENS[4 * i : 4 * i + 4]) not in value
            assert kv_to_host(data[i]).tobytes() not in value
    store = sealed_store(location, l2_pages=3, codec=codec)
    restored = store.restore(KEYS[:3], TOKENS)
    assert restored.sources == [Source.L3] * 3
    assert same_bytes(joined(restored), mx.concatenate(data[:3], axis=3))
    assert store.disk.counters.checksum_failures == 0
    store.release(restored.keys)
    store.close()


@pytest.mark.parametrize("where", ["header", "ciphertext"])
def test_a_flipped_byte_is_never_served(location, where):
    fill(location)
    with records(location) as stored:
        value = bytearray(stored[KEYS[1]])
        nonce = RecordHeader.unpack(memoryview(bytes(value)))[0].nonce
        at = value.find(nonce) + 3 if where == "header" else len(value) - 40  # in the nonce, or the payload
        value[at] ^= 0x01
        stored[KEYS[1]] = bytes(value)
    store = sealed_store(location, l2_pages=3)
    restored = store.restore(KEYS[:3], TOKENS)
    assert restored.sources == [Source.L3]  # recomputed from the flipped page on
    store.release(restored.keys)
    store.settle()
    assert store.disk.counters.checksum_failures == 1 and not store.disk.contains(KEYS[1])
    store.close()


def test_a_reader_without_the_key_or_with_another_serves_nothing(location):
    fill(location)
    raw = kv_to_host(KV[0]).tobytes()
    for reader in (None, cipher(os.urandom(32))):
        with open_l3(location, cipher=reader) as tier:
            assert tier.get(KEYS[0], SEALED.digest(), TOKENS[:4], PAGE) is None
            assert tier.counters.checksum_failures == 1 and tier.counters.hit_pages == 0
        fill(location)  # the rejected record was deleted: write it again
    with open_l3(location, cipher=cipher()) as tier:  # the writer's own key still reads it
        got = tier.get(KEYS[0], SEALED.digest(), TOKENS[:4], PAGE)
        assert got is not None and bytes(got[0]) == raw


def test_an_encrypted_store_serves_no_plain_record(location):
    with open_l3(location) as tier:  # a writer without the key, under the encrypted namespace's key
        tier.put(KEYS[0], SEALED.digest(), TOKENS[:4], kv_to_host(KV[1]).tobytes(), wait=True)
    store = sealed_store(location, l2_pages=1)
    assert store.restore(KEYS[:1], TOKENS).num_pages == 0
    assert store.disk.counters.checksum_failures == 1
    store.close()


def test_a_namespace_must_say_whether_its_store_is_encrypted(tmp_path):
    with pytest.raises(ValueError, match="namespace"):
        TieredStore(GEOMETRY, NS, StoreConfig(0, 0, None, tmp_path, cipher=cipher()))
    with pytest.raises(ValueError, match="namespace"):
        TieredStore(GEOMETRY, SEALED, StoreConfig(0, 0, None, tmp_path))
    assert SEALED.digest() != NS.digest()


def test_each_record_has_a_key_of_its_own():
    """A record's key is derived from its page key (which chains from its tenant's root):
    what one page's record was sealed under opens no other page's."""
    c, ns, nonce, plain, aad = cipher(), b"n" * 16, os.urandom(12), b"kv bytes", b"associated"
    page_a, page_b = b"a" * 16, b"b" * 16
    sealed = c.seal(ns, page_a, nonce, plain, aad)
    assert c.open(ns, page_a, nonce, sealed, aad) == plain
    assert c.open(ns, page_b, nonce, sealed, aad) is None
    assert c.open(b"m" * 16, page_a, nonce, sealed, aad) is None
