"""Reliability of the store (issue 6): crashes, corruption, full and capped tiers, decoder fuzz.

Crash trials run a child process that writes pages to L3 (through ``DiskTier``, or
through ``TieredStore`` spills) and kill it with SIGKILL at a random moment; then the
store must open, every page that reads back must equal what was written, and the meta
numbers must match the records. ``bench/crash_trials.py`` runs more of the same trials.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.l3.lmdb_store import DiskTier
from kvtier.tiers.l3.record import CODECS, QUANTIZED, RECORD_VERSION, CorruptRecord, RecordHeader, decode_record
from kvtier.tiers.page import Namespace, PageGeometry, page_keys
from kvtier.tiers.tier import kv_to_host

from .lmdb_files import followed, raw_env, write_lock
from .test_disk import NS, RECORD_VALUES, TOKENS, key, payload

pytestmark = pytest.mark.slow  # starts processes or loads the real model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


# --- crash trials -------------------------------------------------------------------------


def crash_keys(mode: str, start: int, count: int) -> list[tuple[bytes, bytes, list[int]]]:
    """(key, namespace digest, page token ids) of the pages a crash child writes, in order.

    ``disk`` pages are independent; ``tiered`` pages are the chained pages of one token
    sequence, as the engine publishes them. Shared with the child through its source.
    """
    import hashlib

    if mode == "disk":
        ns = b"crash-namespace!"
        return [
            (hashlib.blake2b(b"crash-%d" % i, digest_size=16).digest(), ns, [i, i + 1, i + 2, i + 3])
            for i in range(start, start + count)
        ]
    from kvtier.tiers.page import Namespace, page_keys

    namespace = Namespace("crash-model", "float32", 4)
    tokens = [(4 * start + t) % (1 << 31) for t in range(4 * count)]
    return [(k, namespace.digest(), tokens[4 * j : 4 * j + 4]) for j, k in enumerate(page_keys(namespace, tokens))]


def crash_payload(mode: str, i: int) -> bytes:
    """Raw bytes of page ``i``: 512 B to 4 KiB for ``disk``, one float32 page of
    ``PageGeometry(2, 1, 8, 4)`` (512 B) for ``tiered``. Shared with the child."""
    import numpy as np

    if mode == "disk":
        return np.random.default_rng(i).bytes(512 * (1 + i % 8))
    return np.random.default_rng(i).standard_normal(128).astype(np.float32).tobytes()


_CHILD_MAIN = """
import random
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])
store, mode = Path(sys.argv[2]), sys.argv[3]
start, count, capacity, queue, seed = map(int, sys.argv[4:9])
codec = sys.argv[9]
rng = random.Random(seed)
pages = crash_keys(mode, start, count)
if mode == "disk":
    from kvtier.tiers.l3.lmdb_store import DiskTier

    tier = DiskTier(store, capacity, codec=codec, queue_pages=queue)
    print("ready", flush=True)
    for n, (k, ns, toks) in enumerate(pages):
        tier.put(k, ns, toks, crash_payload(mode, start + n), wait=True)
        r = rng.random()
        if r < 0.04:
            tier.flush()
        elif r < 0.12 and n:  # an LRU touch, committed by the writer later
            j = rng.randrange(n)
            tier.get(pages[j][0], pages[j][1], pages[j][2], len(crash_payload(mode, start + j)))
        elif r < 0.13:  # a side-table write transaction of its own
            tier.tables.add_persistent_counters({"crash_child": {"puts": n}})
    tier.close()
else:
    import mlx.core as mx
    import numpy as np
    from kvtier.tiers.hierarchy import StoreConfig, TieredStore
    from kvtier.tiers.page import Namespace, PageGeometry

    geometry = PageGeometry(2, 1, 8, 4, "float32")
    namespace = Namespace("crash-model", "float32", 4)
    config = StoreConfig(2 * geometry.nbytes, 2 * geometry.nbytes, capacity, store, codec)
    tiered = TieredStore(geometry, namespace, config)
    tokens = [t for _, _, page in pages for t in page]
    print("ready", flush=True)
    for j, (k, _, toks) in enumerate(pages):
        kv = mx.array(np.frombuffer(crash_payload(mode, start + j), np.float32).reshape(geometry.shape))
        tiered.publish(k, toks, kv)  # L1 -> L2 -> L3 spills as it goes
        if rng.random() < 0.1:
            restored = tiered.restore([p[0] for p in pages[: j + 1]], tokens)
            tiered.release(restored.keys)
        if rng.random() < 0.02:
            tiered.keeping.flush()
    tiered.close()
print("done", flush=True)
"""

CRASH_CHILD = (
    textwrap.dedent(inspect.getsource(crash_keys))
    + "\n"
    + textwrap.dedent(inspect.getsource(crash_payload))
    + _CHILD_MAIN
)


@dataclass
class CrashLog:
    """What the trials wrote (to check what reads back) and what they found."""

    capacity: int
    written: dict = field(default_factory=dict)  # key -> (mode, index, namespace, tokens)
    trials: int = 0
    killed: int = 0  # trials whose child was killed before it finished
    pages_verified: int = 0  # records read back and compared, over all trials
    survived: int = 0  # pages of the killed writers found intact in the store after the kill
    failures: list = field(default_factory=list)
    next_start: int = 0


def _wait_ready(child: subprocess.Popen, timeout: float) -> bool:
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    return bool(ready) and child.stdout.readline().strip() == b"ready"


def assert_consistent(store: Path, capacity: int) -> dict:
    """Read with lmdb directly (the store closed): meta bytes_used and pages match the
    records (absent meta: nothing was ever committed), lru names exactly the records and
    order those no record follows, bytes within the cap. What is stored, as ``test_disk._scan`` reports it."""
    with raw_env(store) as (env, pages, meta):
        with env.begin() as txn:
            sizes = {bytes(k): len(v) for k, v in txn.cursor(db=pages)}
            lru = {bytes(k) for k, _ in txn.cursor(db=env.open_db(b"lru", txn=txn))}
            order = [bytes(k)[8:] for k, _ in txn.cursor(db=env.open_db(b"order", txn=txn))]
            used, npages = (
                msgpack.unpackb(txn.get(name, db=meta) or msgpack.packb(0)) for name in (b"bytes_used", b"pages")
            )
            held = followed(env, txn, sizes)
    assert used == sum(sizes.values()) <= capacity
    assert npages == len(sizes)
    assert lru == set(order) | held == set(sizes) and len(order) + len(held) == len(sizes)  # leaf-first
    return {"sizes": sizes, "bytes_used": used, "pages": npages}


def crash_trial(
    store: Path,
    log: CrashLog,
    rng: random.Random,
    mode: str,
    *,
    count: int = 2000,
    max_delay: float = 0.35,
    verify_with: DiskTier | None = None,
) -> None:
    """One trial: start a writer, SIGKILL it at a random moment, then verify the store."""
    start = log.next_start
    log.next_start += count
    pages = crash_keys(mode, start, count)
    for j, (k, ns, toks) in enumerate(pages):
        log.written[k] = (mode, start + j, ns, toks)
    args = [
        str(REPO),
        str(store),
        mode,
        str(start),
        str(count),
        str(log.capacity),
        str(rng.choice([1, 8, 64])),
        str(rng.randrange(1 << 30)),
        rng.choice([c for c in CODECS if c not in QUANTIZED]),  # (a quantized store needs its own namespace)
    ]
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO
    )
    try:
        if rng.random() < 0.2:  # anywhere: during start-up, while opening the store, or writing
            time.sleep(rng.uniform(0.0, 0.4))
        elif _wait_ready(child, 60):
            time.sleep(rng.uniform(0.0, max_delay))
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
        err = child.stderr.read().decode(errors="replace")
        child.stdout.close()
        child.stderr.close()
    log.trials += 1
    if child.returncode == -signal.SIGKILL:
        log.killed += 1
    elif child.returncode != 0:
        log.failures.append(f"trial {log.trials}: child exited {child.returncode}: {err.strip()[-300:]}")
    try:
        survived = verify_store(store, log, {k for k, _, _ in pages}, verify_with)
    except AssertionError as exc:
        log.failures.append(f"trial {log.trials} ({mode}): {exc}")
        raise
    if child.returncode == -signal.SIGKILL:
        log.survived += survived


def verify_store(store: Path, log: CrashLog, fresh: set[bytes], tier: DiskTier | None = None) -> int:
    """The store opens, every record reads back as written, meta matches the records;
    returns how many of the ``fresh`` pages are stored. ``tier``: this process's open
    handle on the store (py-lmdb opens an environment once per process)."""
    own = tier is None
    tier = DiskTier(store, log.capacity) if own else tier  # StoreError here fails the trial
    failures = tier.counters.checksum_failures
    try:
        present = _check_meta(tier, log.capacity)
        for k in present:
            assert k in log.written, f"record {k.hex()} was never written"
            mode, index, ns, toks = log.written[k]
            expected = crash_payload(mode, index)
            got = tier.get(k, ns, toks, len(expected))
            if got is None and not own and not tier.contains(k):
                continue  # evicted since the listing by a commit of the shared handle's writer
            assert got is not None and got[0] == expected, f"page {k.hex()} does not read back as written"
        assert tier.counters.checksum_failures == failures
        log.pages_verified += len(present)
    finally:
        if own:
            tier.close()
    if own:
        assert_consistent(store, log.capacity)
    return len(fresh.intersection(present))


def _check_meta(tier: DiskTier, capacity: int) -> list[bytes]:
    """Through the open tier's census (one read transaction): meta bytes_used and pages
    match the records, lru names exactly the records and order those no record follows; the record keys."""
    census = tier.census()
    assert census.bytes_used == sum(census.sizes.values()) <= capacity
    assert census.pages == len(census.sizes)
    assert census.lru == set(census.order) | census.followed == set(census.sizes)  # leaf-first: followed ones wait
    assert len(census.order) + len(census.followed) == len(census.sizes)
    return list(census.sizes)


def run_crash_trials(store: Path, trials: int, seed: int, tiered_every: int = 5, **kw) -> CrashLog:
    """``trials`` crash trials on one store (every ``tiered_every``-th through TieredStore)."""
    rng = random.Random(seed)
    log = CrashLog(capacity=1 << 20)
    for t in range(trials):
        mode = "tiered" if tiered_every and t % tiered_every == tiered_every - 1 else "disk"
        crash_trial(store, log, rng, mode, count=2000 if mode == "disk" else 1500, **kw)
    return log


def test_writers_killed_at_random_moments_leave_a_sound_store(tmp_path: Path) -> None:
    seed = int.from_bytes(os.urandom(4), "little")  # bench/crash_trials.py --seed replays it
    try:
        log = run_crash_trials(tmp_path / "store", trials=24, seed=seed)
    except AssertionError as exc:
        raise AssertionError(f"crash trials with seed {seed}: {exc}") from None
    print(
        f"{log.trials} trials, {log.killed} killed, {log.pages_verified} pages verified, "
        f"{log.survived} pages of killed writers survived"
    )
    assert not log.failures, (seed, log.failures)
    assert log.trials == 24 and log.killed >= 20, (seed, log)  # a child may finish before its kill
    assert log.survived > 0 and log.pages_verified > 0


def test_one_writer_killed_while_others_read_and_write(tmp_path: Path) -> None:
    """A kill while another process has the store open (readers, its own writer thread)."""
    store = tmp_path / "store"
    log = CrashLog(capacity=1 << 20)
    other = DiskTier(store, log.capacity)
    rng = random.Random(5)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:  # reads whatever the killed writers committed
        try:
            while not stop.is_set():
                # dict.copy copies the table in one C call: iterating the shared dict while
                # this test's main thread adds to it can raise (a collection may run mid-way)
                for k, (mode, index, ns, toks) in list(log.written.copy().items())[-300:]:
                    got = other.get(k, ns, toks, len(crash_payload(mode, index)))
                    assert got is None or got[0] == crash_payload(mode, index)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    mine: list[bytes] = []
    try:
        for trial in range(12):  # 4 trials, more until a kill lands mid-write (load-dependent)
            if trial >= 4 and log.killed:
                break
            (k, ns, toks), index = crash_keys("disk", log.next_start, 1)[0], log.next_start
            log.next_start += 1
            log.written[k] = ("disk", index, ns, toks)
            other.put(k, ns, toks, crash_payload("disk", index))  # this process writes too
            mine.append(k)
            crash_trial(store, log, rng, "disk", count=2000, verify_with=other)
    finally:
        stop.set()
        thread.join()
    other.close()
    assert not errors and not log.failures, (errors, log.failures)
    assert other.counters.checksum_failures == 0
    assert log.killed >= 1
    assert other.counters.inserts == len(mine)  # committed (LRU may have evicted them since)
    assert_consistent(store, log.capacity)


# --- corruption ---------------------------------------------------------------------------


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


@pytest.mark.parametrize("codec", ["raw", "zstd-shuffle"])
def test_random_flips_in_headers_and_payloads_are_all_detected(tmp_path: Path, codec: str) -> None:
    """Random byte flips in 40 of 60 records: every damaged record is a counted miss and
    deleted; every intact one still reads back."""
    store = tmp_path / "store"
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    n = 60
    size = [512 * (1 + i % 8) for i in range(n)]
    tier = DiskTier(store, 1 << 24, codec=codec, queue_pages=n)
    for i in range(n):
        tier.put(key(i), NS, TOKENS, payload(i, size[i]))
    tier.close()
    damaged = set(rng.sample(range(n), 40))
    with raw_env(store) as (env, pages, _):
        with env.begin(write=True) as txn:
            for i in damaged:
                txn.put(key(i), damage_record(bytes(txn.get(key(i), db=pages)), rng, in_header=i % 2 == 1), db=pages)
    tier = DiskTier(store, 1 << 24)
    for i in range(n):
        got = tier.get(key(i), NS, TOKENS, size[i])
        assert got is None if i in damaged else got[0] == payload(i, size[i])
    assert tier.counters.checksum_failures == len(damaged)
    tier.flush()
    assert tier.counters.pages == n - len(damaged)
    assert not any(tier.contains(key(i)) for i in damaged)
    tier.close()
    assert_consistent(store, 1 << 24)


def test_rejected_page_can_be_stored_again_before_its_delete_commits(store: Path) -> None:
    """Between a rejected get and the commit of its delete, the page reads as absent and
    a recomputed copy is accepted (the writer deletes before it inserts)."""
    with DiskTier(store, 1 << 20) as tier:
        tier.put(key(0), NS, TOKENS, payload(0))
    with raw_env(store) as (env, pages, _), env.begin(write=True) as txn:
        value = bytearray(txn.get(key(0), db=pages))
        value[-1] ^= 0x40
        txn.put(key(0), bytes(value), db=pages)
    tier = DiskTier(store, 1 << 20)
    with write_lock(store):  # the writer cannot commit the delete yet
        assert tier.get(key(0), NS, TOKENS, 4096) is None
        assert not tier.contains(key(0))
        assert tier.get(key(0), NS, TOKENS, 4096) is None  # a second look: counted once
        assert tier.put(key(0), NS, TOKENS, payload(0))  # the recomputed page
    tier.flush()
    assert tier.counters.checksum_failures == 1
    assert tier.get(key(0), NS, TOKENS, 4096)[0] == payload(0)
    tier.close()
    assert_consistent(store, 1 << 20)


def test_records_of_another_format_version_are_never_served(store: Path) -> None:
    tier = DiskTier(store, 1 << 20, queue_pages=4)
    for i in range(4):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.close()
    with raw_env(store) as (env, pages, _):
        with env.begin(write=True) as txn:
            for i in (1, 3):
                value = bytes(txn.get(key(i), db=pages))
                header, offset = RecordHeader.unpack(memoryview(value))
                other = RecordHeader(
                    RECORD_VERSION + 1,
                    *[getattr(header, f) for f in ("key", "namespace", "tokens", "codec", "raw_len", "checksum")],
                )
                padded = other.pack(offset - len(header.pack()))  # the record keeps its length
                txn.put(key(i), padded + value[offset:], db=pages)
    tier = DiskTier(store, 1 << 20)
    got = [tier.get(key(i), NS, TOKENS, 4096) for i in range(4)]
    assert got[1] is None and got[3] is None and got[0][0] == payload(0) and got[2][0] == payload(2)
    assert tier.counters.checksum_failures == 2
    tier.close()
    assert set(assert_consistent(store, 1 << 20)["sizes"]) == {key(0), key(2)}


_OPEN_AND_READ = """
import hashlib, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.lmdb_store import DiskTier
n = int(sys.argv[2])
keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)]  # test_disk.key
for store in sys.argv[3:]:
    print(store, end=": ", flush=True)
    try:
        tier = DiskTier(Path(store), 1 << 24)
    except StoreError as err:
        print("refused", err, flush=True)
        continue
    found = sum(tier.get(k, b"N" * 16, list(range(8)), 4096) is not None for k in keys)
    tier.close()
    print("opened", found, flush=True)
"""


def test_truncated_store_file_is_refused_not_a_crash(tmp_path: Path) -> None:
    """LMDB checks only the meta pages: a data file cut short opens, and the first read past
    its end kills the process (SIGBUS). Every cut must be refused with a StoreError, or
    (an empty file) opened as a new store. The opens run in a child: a crash kills it, not pytest."""
    n = 64
    source = tmp_path / "source"
    tier = DiskTier(source, 1 << 24, queue_pages=n)
    for i in range(n):
        tier.put(key(i), NS, TOKENS, payload(i))
    tier.close()
    size = (source / "data.mdb").stat().st_size
    cuts = (0, 4096, 8192, 3 * 4096, size // 2, size - 4096, size - 1)
    stores = []
    for cut in cuts:
        stores.append(tmp_path / f"cut-{cut}")
        shutil.copytree(source, stores[-1])
        os.truncate(stores[-1] / "data.mdb", cut)
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_AND_READ, str(REPO), str(n), *map(str, stores)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 0, (done.returncode, done.stdout.splitlines()[-1:], done.stderr[-500:])
    outcomes = [line.split(": ", 1)[1] for line in done.stdout.splitlines()]
    assert outcomes[0] == "opened 0"  # LMDB treats an empty file as a new environment
    assert all(o.startswith("refused cannot open store") or o.startswith("refused store file") for o in outcomes[1:]), (
        outcomes
    )
    assert len(outcomes) == len(cuts)


# --- full and capped tiers ----------------------------------------------------------------

GEOMETRY = PageGeometry(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32")
NAMESPACE = Namespace("reliability", "float32", 4)
PAGE = GEOMETRY.nbytes


def page_kv(i: int) -> mx.array:
    kv = mx.array(np.random.default_rng(1000 + i).standard_normal(GEOMETRY.shape).astype(np.float32))
    mx.eval(kv)
    return kv


def sequences(n: int, pages: int) -> list[tuple[list[int], list[bytes]]]:
    """n token sequences of ``pages`` full pages each; the later ones share prefixes."""
    out = []
    for s in range(n):
        shared = (s // 2) * 2  # sequences 2k and 2k+1 share their first pages
        tokens = [shared * 1000 + t for t in range(4 * pages // 2)]
        tokens += [s * 1000 + 500 + t for t in range(4 * pages - len(tokens))]
        out.append((tokens, page_keys(NAMESPACE, tokens)))
    return out


def test_l3_full_evicts_and_stays_under_its_cap(tmp_path: Path) -> None:
    record = PAGE + 100  # header is under 100 bytes
    cap = 3 * record
    store = TieredStore(GEOMETRY, NAMESPACE, StoreConfig(PAGE, PAGE, cap, tmp_path))
    tokens = list(range(4 * 30))
    keys = page_keys(NAMESPACE, tokens)
    for i, k in enumerate(keys):
        store.publish(k, tokens[4 * i : 4 * i + 4], page_kv(i))
        store.disk.flush()
        assert store.disk.counters.bytes_used <= cap and store.disk.counters.pages <= 3
    assert store.disk.counters.evictions >= 30 - 2 - 3
    assert len(store.restore(keys, tokens).keys) == 0  # the first pages were evicted: a miss
    store.close()
    assert_consistent(tmp_path, cap)


def test_l3_smaller_than_a_page_drops_and_counts_every_write(tmp_path: Path) -> None:
    store = TieredStore(GEOMETRY, NAMESPACE, StoreConfig(PAGE, PAGE, PAGE // 2, tmp_path))
    tokens = list(range(4 * 10))
    keys = page_keys(NAMESPACE, tokens)
    for i, k in enumerate(keys):
        store.publish(k, tokens[4 * i : 4 * i + 4], page_kv(i))
    store.close()  # flush sends the pages still in L1 and L2: all 10 reached L3 once
    assert store.disk.counters.writes_dropped == 10 and store.disk.counters.inserts == 0
    assert assert_consistent(tmp_path, PAGE // 2)["pages"] == 0


def test_requests_never_wait_for_a_stuck_l3(tmp_path: Path) -> None:
    """L3 cannot commit (another transaction holds LMDB's write lock): publishes and
    restores still return at once; the spills that find the queue full are dropped and counted."""
    store = TieredStore(GEOMETRY, NAMESPACE, StoreConfig(PAGE, PAGE, 1 << 20, tmp_path))
    tokens = list(range(4 * 200))
    keys = page_keys(NAMESPACE, tokens)
    hits = 0
    with write_lock(tmp_path):
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            store.publish(k, tokens[4 * i : 4 * i + 4], page_kv(i % 16))
            for first in (0, i):  # a prefix that went down to the stuck L3, and the newest page
                restored = store.restore(keys[first : i + 1], tokens[4 * first :])
                store.release(restored.keys)
                hits += len(restored.keys)
        elapsed = time.perf_counter() - t0
    assert elapsed < 10, f"requests stalled behind L3 ({elapsed:.1f} s)"
    assert store.disk.counters.writes_dropped > 0 and hits >= len(keys)
    store.close()
    assert_consistent(tmp_path, 1 << 20)


def test_caps_hold_and_bytes_survive_a_long_mixed_workload(tmp_path: Path) -> None:
    """Publish, restore (pinning), release and flush at random over shared prefixes:
    L1, L2 and L3 stay under their caps at every step, and every restore is exact."""
    rng = random.Random(23)
    l1, l2, l3 = 3 * PAGE, 5 * PAGE, 12 * (PAGE + 100)
    store = TieredStore(GEOMETRY, NAMESPACE, StoreConfig(l1, l2, l3, tmp_path))
    seqs = sequences(10, 8)  # 50 distinct pages: more than the three tiers hold together
    kvs = {k: page_kv(i) for tokens, ks in seqs for i, k in enumerate(ks)}
    pinned: list[list] = []
    peak = {"L1": 0, "L2": 0}
    sources: set = set()
    for _ in range(800):
        tokens, ks = rng.choice(seqs)
        op = rng.random()
        if op < 0.4:  # a request that computed its first pages publishes them (stored ones: no-op)
            for i in range(rng.randint(1, len(ks))):
                store.publish(ks[i], tokens[4 * i : 4 * i + 4], kvs[ks[i]])
        elif op < 0.7:
            restored = store.restore(ks[: rng.randint(1, len(ks))], tokens)
            for i, k in enumerate(restored.keys):
                page = mx.stack(
                    [
                        mx.concatenate([kk[:, :, 4 * i : 4 * i + 4], vv[:, :, 4 * i : 4 * i + 4]])
                        for kk, vv in restored.layers
                    ]
                )
                assert np.array_equal(kv_to_host(page), kv_to_host(kvs[k]))
            sources.update(restored.sources)
            pinned.append(restored.keys)
        elif op < 0.95:
            if pinned:
                store.release(pinned.pop(rng.randrange(len(pinned))))
        else:
            store.disk.flush()
            assert store.disk.counters.bytes_used <= l3
        for tier, cap in ((store.l1, l1), (store.l2, l2)):
            assert tier.counters.bytes_used == len(tier.entries) * PAGE <= cap
            peak[tier.name] = max(peak[tier.name], tier.counters.bytes_used)
    assert peak == {"L1": l1, "L2": l2}  # the workload did fill both
    assert len(sources) == 3 and store.disk.counters.evictions > 0  # pages came from every tier
    assert all(t.evictions > 0 for t in (store.l1.counters, store.l2.counters))
    store.close()
    assert_consistent(tmp_path, l3)


_WRITER = """
import sys
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from tests.tiers.test_disk import NS, TOKENS, key, payload
from kvtier.tiers.l3.lmdb_store import DiskTier
tier = DiskTier(Path(sys.argv[2]), 1 << 24, codec=sys.argv[3])
order = list(range(int(sys.argv[4])))
if sys.argv[5] == "reverse":
    order.reverse()
for n, i in enumerate(order):
    tier.put(key(i), NS, TOKENS, payload(i), wait=True)
    got = tier.get(key(order[n // 2]), NS, TOKENS, 4096)
    assert got is None or got[0] == payload(order[n // 2])
tier.close()
assert tier.counters.checksum_failures == 0
print(tier.counters.inserts)
"""


def test_four_processes_write_one_store_at_once(store: Path) -> None:
    n = 150
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(REPO), str(store), codec, str(n), order],
            stdout=subprocess.PIPE,
            text=True,
        )
        for codec, order in (("raw", "forward"), ("zstd", "reverse"), ("zstd-shuffle", "forward"), ("raw", "reverse"))
    ]
    inserts = [int(child.communicate(timeout=120)[0]) for child in children]
    assert [child.returncode for child in children] == [0] * 4
    assert sum(inserts) == n  # write-once across processes
    s = assert_consistent(store, 1 << 24)
    assert s["pages"] == n
    tier = DiskTier(store, 1 << 24)
    assert all(tier.get(key(i), NS, TOKENS, 4096)[0] == payload(i) for i in range(n))
    tier.close()


# --- the record decoder, fuzzed -----------------------------------------------------------

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
    RECORD_VALUES,  # raw bytes, and random header dictionaries framed (from test_disk)
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
