"""Pages and records for the L3 (DiskTier) tests: keys, payloads, what the store
really holds (read with lmdb directly, the tier closed), a value stored behind the
tier's back, a stored value damaged, and arbitrary record values for the decoders."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import msgpack
import numpy as np
from hypothesis import strategies as st

from kvtier.tiers.l3.record import CorruptRecord, RecordHeader, decode_record

from .lmdb_files import followed, raw_env

NS = b"N" * 16
TOKENS = list(range(8))


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload(i: int, nbytes: int = 4096) -> bytes:
    """bf16-like page bytes: normal floats, top 16 bits of float32 (compressible like real KV)."""
    values = np.random.default_rng(i).standard_normal(nbytes // 2).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _scan_store(path: Path) -> dict:
    """What is really stored, read with lmdb directly (the tier must be closed)."""
    with raw_env(path) as (env, pages, meta):
        with env.begin() as txn:
            sizes = {bytes(k): len(v) for k, v in txn.cursor(db=pages)}
            lru = {bytes(k) for k, _ in txn.cursor(db=env.open_db(b"lru", txn=txn))}
            order = [bytes(k)[8:] for k, _ in txn.cursor(db=env.open_db(b"order", txn=txn))]
            used, npages = (
                msgpack.unpackb(txn.get(name, db=meta) or msgpack.packb(0)) for name in (b"bytes_used", b"pages")
            )
            held = followed(env, txn, sizes)
    return {"sizes": sizes, "lru": lru, "order": order, "followed": held, "bytes_used": used, "pages": npages}


def assert_consistent(path: Path, capacity: int) -> dict:
    """What is stored (``_scan_store``), checked: meta bytes_used and pages match the
    records (absent meta: nothing was ever committed), lru names exactly the records and
    order those no record follows (leaf-first), bytes within the cap."""
    s = _scan_store(path)
    assert s["bytes_used"] == sum(s["sizes"].values()) <= capacity
    assert s["pages"] == len(s["sizes"])
    assert s["lru"] == set(s["order"]) | s["followed"] == set(s["sizes"])  # leaf-first: followed ones wait
    assert len(s["order"]) + len(s["followed"]) == len(s["sizes"])
    return s


def poke(store: Path, k: bytes, value: bytes) -> None:
    """Store a raw value behind the tier's back (the store closed), meta kept in step."""
    with raw_env(store) as (env, pages, meta), env.begin(write=True) as txn:
        old = txn.get(k, db=pages)
        txn.put(k, value, db=pages)
        used = msgpack.unpackb(txn.get(b"bytes_used", db=meta) or msgpack.packb(0))
        count = msgpack.unpackb(txn.get(b"pages", db=meta) or msgpack.packb(0))
        txn.put(b"bytes_used", msgpack.packb(used + len(value) - len(old or b"")), db=meta)
        txn.put(b"pages", msgpack.packb(count + (old is None)), db=meta)


_HEADER_KEYS = st.sampled_from(["v", "ns", "tok", "codec", "n", "xxh", "x"])
_HEADER_VALUES = st.one_of(
    st.integers(-2, 2**64 - 1),
    st.binary(max_size=40),
    st.text(max_size=12),
    st.none(),
    st.booleans(),
    st.sampled_from(["raw", "zstd", "zstd-shuffle"]),
    st.just(NS),
    st.just(np.asarray(TOKENS, "<u4").tobytes()),
)


def _framed(header: dict, tail: bytes) -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    return len(head).to_bytes(4, "little") + head + tail


RECORD_VALUES = st.one_of(
    st.binary(max_size=300),
    st.builds(_framed, st.dictionaries(_HEADER_KEYS, _HEADER_VALUES, max_size=7), st.binary(max_size=300)),
)


def damage_record(value: bytes, rng: random.Random, in_header: bool) -> bytes:
    """1-3 random bytes flipped in the header or in the payload of a stored value, such that
    it no longer yields its page. (A flip may leave an equivalent record: msgpack has
    several encodings of one integer, a zstd frame may have slack; such a draw is redrawn.
    Either way the decoder never serves other bytes: see the fuzz test.)"""
    header, _ = RecordHeader.unpack(memoryview(value))
    header_end = 4 + int.from_bytes(value[:4], "little")
    while True:
        bad = bytearray(value)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(header_end) if in_header else rng.randrange(header_end, len(value))
            bad[pos] ^= rng.randint(1, 255)
        try:
            decode_record(header.key, memoryview(bytes(bad)), header.namespace, header.tokens, header.raw_len)
        except CorruptRecord:
            return bytes(bad)
