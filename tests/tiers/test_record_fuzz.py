"""Reliability of the store (issue 6): the record decoder, fuzzed: it yields the page or
``CorruptRecord``, never other bytes and never another error."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvtier.tiers.l3.lmdb_store import DiskTier
from kvtier.tiers.l3.record import CODECS, RECORD_VERSION, CorruptRecord, RecordHeader, decode_record

from .disk_pages import NS, RECORD_VALUES, TOKENS, key, payload
from .lmdb_files import raw_env

pytestmark = pytest.mark.slow  # starts processes or loads the real model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


FUZZ_TOKENS = np.asarray(TOKENS, "<u4").tobytes()
FUZZ_KEY = key(0)  # the key the arbitrary values are looked up under


@functools.cache
def seed_records() -> list[tuple[bytes, bytes, bytes]]:
    """(page key, raw page, stored record) written by a real DiskTier: every codec, odd and empty sizes."""
    import tempfile

    raws = [
        b"",
        b"\x01",
        payload(1, 64),
        payload(2, 256)[:-1],
        np.random.default_rng(3).bytes(200),
        bytes(300),
        payload(4, 512),
    ]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for codec in CODECS:
            tier = DiskTier(Path(tmp) / codec, 1 << 20, codec=codec, queue_pages=len(raws))
            for i, raw in enumerate(raws):
                tier.put(key(i), NS, TOKENS, raw)
            tier.close()
            with raw_env(Path(tmp) / codec) as (env, pages, _), env.begin(db=pages) as txn:
                out += [(key(i), raw, bytes(txn.get(key(i)))) for i, raw in enumerate(raws)]
    return out


_POS = st.one_of(st.integers(0, 110), st.integers(0, 1 << 20))  # headers are about 80-110 bytes
MUTATION = st.one_of(
    st.tuples(st.just("flip"), _POS, st.integers(1, 255)),
    st.tuples(st.just("cut"), _POS),
    st.tuples(st.just("insert"), _POS, st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), _POS, st.integers(1, 16)),
    st.tuples(st.just("overwrite"), _POS, st.binary(min_size=1, max_size=16)),
)


def _mutate(value: bytes, mutations: list[tuple]) -> bytes:
    b = bytearray(value)
    for kind, pos, *arg in mutations:
        pos %= len(b) + 1
        if kind == "flip" and pos < len(b):
            b[pos] ^= arg[0]
        elif kind == "cut":
            del b[pos:]
        elif kind == "insert":
            b[pos:pos] = arg[0]
        elif kind == "delete":
            del b[pos : pos + arg[0]]
        elif kind == "overwrite":
            b[pos : pos + len(arg[0])] = arg[0]
    return bytes(b)


def decode(value: bytes, page_key: bytes, raw_nbytes: int, out: bool) -> bytes | None:
    """The page a stored value yields, or None for a clean "corrupt"; anything else raises."""
    buffer = np.empty(raw_nbytes, np.uint8) if out else None
    try:
        got = decode_record(page_key, memoryview(value), NS, FUZZ_TOKENS, raw_nbytes, buffer)
    except CorruptRecord:
        return None
    return got.tobytes() if out else bytes(got)


_HEADER_FOR_US = st.fixed_dictionaries(
    {
        "v": st.sampled_from([RECORD_VERSION, RECORD_VERSION + 1, 1, 0, -1, 2**64 - 1]),
        "key": st.sampled_from([FUZZ_KEY, FUZZ_KEY[:-1], key(1), b""]),
        "ns": st.sampled_from([NS, NS[:-1], b""]),
        "tok": st.sampled_from([FUZZ_TOKENS, FUZZ_TOKENS[:-1], b""]),
        "codec": st.sampled_from([*CODECS, "lz4", ""]),
        "n": st.sampled_from([0, 1, 63, 64, 65, 2**32, 2**64 - 1]),
        "xxh": st.integers(0, 2**64 - 1),
    }
)


def _framed_ours(header: dict, data: bytes, kind: str, fix_checksum: bool) -> bytes:
    """A header about our page (fields right or nearly) over a raw or zstd payload."""
    import zstandard

    if fix_checksum:
        header = {**header, "xxh": xxh3_64_intdigest(data)}
    if kind != "raw":
        data = zstandard.ZstdCompressor(write_content_size=kind == "zstd").compress(data)
    head = msgpack.packb(header, use_bin_type=True)
    return len(head).to_bytes(4, "little") + head + data


ARBITRARY = st.one_of(
    RECORD_VALUES,  # raw bytes, and random header dictionaries framed (tests.tiers.disk_pages)
    st.builds(
        _framed_ours,
        _HEADER_FOR_US,
        st.binary(max_size=130),
        st.sampled_from(["raw", "zstd", "zstd-no-size"]),
        st.booleans(),
    ),
)
_FAST = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


def test_fuzz_record_decoder_yields_the_page_or_corrupt() -> None:
    """Over 10,000 stored values through the L3 decoder (``RecordHeader.unpack`` and
    ``decode_record``, with and without an ``out`` buffer): it returns the page's own
    bytes, or a clean ``CorruptRecord``; it never raises anything else or serves other bytes."""
    seeds = seed_records()
    inputs: set[int] = set()

    @settings(max_examples=700, **_FAST)
    @given(mutations=st.lists(MUTATION, min_size=1, max_size=4))
    def damaged(mutations: list) -> None:
        # Each step of one damage recipe, applied to every seed record (each codec, odd
        # and empty sizes): many decoder inputs per example keep the fuzz fast.
        for page_key, raw, value in seeds:
            for steps in range(1, len(mutations) + 1):
                bad = _mutate(value, mutations[:steps])
                inputs.add(xxh3_64_intdigest(bad))
                for out in (False, True):
                    got = decode(bad, page_key, len(raw), out)
                    assert got is None or got == raw
                    assert bad != value or got == raw

    @settings(max_examples=500, **_FAST)
    @given(value=ARBITRARY, raw_nbytes=st.sampled_from([0, 1, 63, 64, 65]))
    def arbitrary(value: bytes, raw_nbytes: int) -> None:
        inputs.add(xxh3_64_intdigest(value))
        try:
            header = RecordHeader.unpack(memoryview(value))[0]
        except CorruptRecord:
            header = None
        for out in (False, True):
            got = decode(value, FUZZ_KEY, raw_nbytes, out)
            if got is not None:  # only with every field right and the checksum over the bytes
                assert header is not None and header.version == RECORD_VERSION and header.key == FUZZ_KEY
                assert header.namespace == NS and header.tokens == FUZZ_TOKENS
                assert len(got) == raw_nbytes == header.raw_len
                assert xxh3_64_intdigest(got) == header.checksum

    t0 = time.perf_counter()
    damaged()
    t1 = time.perf_counter()
    arbitrary()
    print(f"fuzz: {len(inputs)} distinct values ({t1 - t0:.1f} s + {time.perf_counter() - t1:.1f} s)")
    assert len(inputs) >= 10_000, len(inputs)
