"""Failure behaviour (DESIGN §9, issue 6) through the CLI, as a user meets it.

Every run's output is checked against a ``--no-offload`` run of the same prompts: a
fault in the store may cost time, never a different answer. Small geometry keeps it
fast: 8-token pages, four prompts of 30 to 45 tokens (16 reusable pages), 6 new tokens.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from kvtier.costmodel.models import ComputeModel
from kvtier.costmodel.plan import Profile
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.l3.lmdb_store import DiskTier
from kvtier.tiers.l3.record import FORMAT_VERSION, RecordHeader, decode_record
from kvtier.tiers.page import page_keys, reusable_pages

from .. import cli
from ..tiers.disk_pages import assert_consistent, damage_record
from ..tiers.lmdb_files import raw_env
from .conftest import on_tiny_model, text_prompt

pytestmark = pytest.mark.slow  # starts processes or loads the real model

REPO = Path(__file__).resolve().parents[2]
PAGE = 8
MAX_TOKENS = 6
PAGE_BYTES = PAGE * 24 * 2 * 2 * 64 * 4  # the default model's float32 KV: 196,608 bytes a page
_WORDS = [
    "cache",
    "page",
    "tier",
    "restore",
    "token",
    "prefix",
    "model",
    "host",
    "disk",
    "lmdb",
    "alpha",
    "zeta",
    "Q",
    "!",
    "42",
]


def _prompt(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))[:n]


def prompt_set(k: int) -> list[str]:
    """Four distinct prompts of 30 to 45 tokens; set 0 is PROMPTS."""
    return [_prompt(100 * k + s, 30 + 5 * s) for s in range(4)]


PROMPTS = prompt_set(0)
REUSABLE = [reusable_pages(len(p), PAGE) for p in PROMPTS]  # pages a prompt restores
STORED = [len(p) // PAGE for p in PROMPTS]  # pages a run stores: every full page, the last one too


def kvtier(*args: str) -> subprocess.CompletedProcess:
    return cli.run(on_tiny_model(args), cwd=REPO)


def run_args(store: Path | None, *extra: str, prompts: list[str] = PROMPTS) -> list[str]:
    args = ["run", "--json", "--max-tokens", str(MAX_TOKENS), "--page-size", str(PAGE), *extra]
    args += ["--no-offload"] if store is None else ["--store", str(store)]
    for p in prompts:
        args += ["--prompt", p]
    return on_tiny_model(args)


def parse(done: subprocess.CompletedProcess) -> tuple[list[dict], dict]:
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return lines[:-1], lines[-1]["counters"]


def run(store: Path | None, *extra: str, prompts: list[str] = PROMPTS) -> tuple[list[dict], dict, str]:
    done = kvtier(*run_args(store, *extra, prompts=prompts))
    results, counters = parse(done)
    return results, counters, done.stderr


def outputs(results: list[dict]) -> list[list[int]]:
    return [r["output_token_ids"] for r in results]


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def seed_profile(store: Path, loaded) -> None:
    """Store a cost profile as ``kvtier calibrate`` would write it on this kind of machine
    (prefill about 2 ms a token), so that the planner restores every stored page and a
    test sees every L3 read. (Uncalibrated defaults assume prefill 10x faster; with
    8-token pages they make restore-or-recompute a coin toss. Calibrating takes 30 s.)"""
    profile = Profile.defaults()
    profile.compute = ComputeModel([0.02, 0.002, 3e-6])
    profile.calibrated = True
    tier = DiskTier(store, 32 << 30)
    tier.tables.put_meta(loaded.profile_key(loaded.geometry(PAGE)), profile.to_dict())
    tier.close()


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    """Output token ids of the prompts with no store at all (the oracle)."""
    results, _, _ = run(None)
    assert len({tuple(o) for o in outputs(results)}) == len(PROMPTS)  # the prompts tell apart
    return outputs(results)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, baseline, loaded) -> Path:
    """A store holding every reusable page of the prompts (one cold run), and a profile."""
    store = tmp_path_factory.mktemp("written") / "store"
    seed_profile(store, loaded)
    results, counters, _ = run(store)
    assert outputs(results) == baseline
    assert counters["tiers"]["L3"]["inserts"] == sum(STORED)
    assert counters["costmodel"]["calibrated"], "the engine did not read the seeded profile"
    return store


def copy_of(store: Path, tmp_path: Path) -> Path:
    target = tmp_path / "store"
    shutil.copytree(store, target)
    return target


def verify_records(store: Path, capacity: int = 32 << 30) -> int:
    """Without knowing what was written: the store opens, meta matches the records, and
    every record passes its own header and checksum. The number of records."""
    DiskTier(store, capacity).close()
    s = assert_consistent(store, capacity)
    with raw_env(store) as (env, pages, _):
        with env.begin(buffers=True) as txn:
            for _, value in txn.cursor(db=pages):
                header, _ = RecordHeader.unpack(value)
                decode_record(header.key, value, header.namespace, header.tokens, header.raw_len)  # _Corrupt fails
    return s["pages"]


def snapshot(store: Path) -> dict:
    """Every record's bytes and the meta gauges (the store must be closed)."""
    with raw_env(store) as (env, pages, meta):
        with env.begin() as txn:
            records = {bytes(k): bytes(v) for k, v in txn.cursor(db=pages)}
            gauges = {name: txn.get(name, db=meta) for name in (b"bytes_used", b"pages", b"format_version")}
    return {"records": records, "meta": gauges}


# --- process killed mid-write -----------------------------------------------------------------


def _has_store_mapped(pid: int, data: Path) -> bool:
    """The process has opened the store (its data file is in its memory map)."""
    try:
        return str(data) in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def cli_crash_trial(
    store: Path, rng: random.Random, prompts: list[str], *, grown: bool, max_delay: float = 1.5
) -> dict:
    """Start ``kvtier run`` on ``prompts`` (small L1 and L2: pages spill to L3 during the run)
    and SIGKILL it: at a random moment after it opened the store, or (``grown``) as soon as
    the store file grows by a page (pages being committed). Then the store must open and
    every record must check."""
    data = store / "data.mdb"
    size0 = data.stat().st_size if data.exists() else 0
    args = run_args(store, "--l1-bytes", str(2 * PAGE_BYTES), "--l2-bytes", str(2 * PAGE_BYTES), prompts=prompts)
    child = subprocess.Popen(
        [sys.executable, "-m", "kvtier.engine.cli", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    delay, opened_at = rng.uniform(0.0, max_delay), None
    while child.poll() is None and time.monotonic() < deadline:
        if grown:
            if data.exists() and data.stat().st_size > size0 + PAGE_BYTES // 2:
                break
        elif opened_at is None:
            if _has_store_mapped(child.pid, data.resolve()):
                opened_at = time.monotonic()
        elif time.monotonic() - opened_at >= delay:
            break
        time.sleep(0.002)
    child.send_signal(signal.SIGKILL)
    child.wait()
    return {"killed": child.returncode == -signal.SIGKILL, "records": verify_records(store)}


def prompt_page_keys(prompts: list[str], loaded, reusable: bool = True) -> list[list[bytes]]:
    """Each prompt's reusable page keys, or with ``reusable=False`` every full page's
    (what a run stores); prompts that start alike share their first pages."""
    namespace = loaded.namespace(loaded.geometry(PAGE))
    keys = []
    for text in prompts:
        tokens = loaded.tokenizer.encode(text)
        keys.append(page_keys(namespace, tokens)[: reusable_pages(len(tokens), PAGE) if reusable else None])
    return keys


def leading_stored_pages(store: Path, prompts: list[str], loaded) -> int:
    """Over the prompts: how many leading pages of each are in the store (closed)."""
    with raw_env(store) as (env, pages, _):
        with env.begin() as txn:
            stored = {bytes(k) for k, _ in txn.cursor(db=pages)}
    total = 0
    for keys in prompt_page_keys(prompts, loaded):
        for k in keys:
            if k not in stored:
                break
            total += 1
    return total


def test_runs_killed_mid_write_leave_a_store_that_serves_correct_pages(tmp_path, baseline, loaded):
    store = tmp_path / "store"
    seed_profile(store, loaded)
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    # Each trial brings new prompts (so it has pages to write). First a kill as soon as the
    # file grows: pages written, usually before their commit's meta page (nothing of that
    # commit may show); then kills at random moments.
    trials = [cli_crash_trial(store, rng, prompt_set(k), grown=k == 0) for k in range(3)]
    assert trials[0]["killed"], trials
    everything = [p for k in range(3) for p in prompt_set(k)]
    expected = outputs(run(None, prompts=everything)[0])
    leading = leading_stored_pages(store, everything, loaded)
    results, counters, _ = run(store, prompts=everything)
    assert outputs(results) == expected
    assert counters["tiers"]["L3"]["checksum_failures"] == 0
    # What the kills left is served: every stored page whose prefix pages are stored too
    # (whole pages: a prompt may also share the start of a page another prompt left in L1).
    restored = sum((r["sources"]["L1"] + r["sources"]["L2"] + r["sources"]["L3"]) // PAGE for r in results)
    assert restored == leading, (restored, leading, trials)
    stored = {k for keys in prompt_page_keys(everything, loaded, reusable=False) for k in keys}
    assert verify_records(store) == len(stored)


# --- corrupt pages -----------------------------------------------------------------------------


def _records_by_page(store: Path, loaded) -> dict[tuple[int, int], bytes]:
    """(prompt, page index) -> record key, matched through the token ids in each header."""
    want = {}
    for p, text in enumerate(PROMPTS):
        tokens = loaded.tokenizer.encode(text)
        for j in range(STORED[p]):
            want[np.asarray(tokens[j * PAGE : (j + 1) * PAGE], "<u4").tobytes()] = (p, j)
    found = {}
    with raw_env(store) as (env, pages, _):
        with env.begin() as txn:
            for k, value in txn.cursor(db=pages):
                header, _ = RecordHeader.unpack(memoryview(value))
                found[want[header.tokens]] = bytes(k)
    assert len(found) == sum(STORED)
    return found


def test_corrupt_records_are_detected_deleted_and_recomputed(tmp_path, baseline, written, loaded):
    store = copy_of(written, tmp_path)
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    records = _records_by_page(store, loaded)
    # One damaged page per prompt (a restore stops at the first bad page, so later ones
    # would wait for the next run), headers in two prompts and payloads in the other two.
    damaged = {p: rng.randrange(REUSABLE[p]) for p in range(len(PROMPTS))}
    with raw_env(store) as (env, pages, _):
        with env.begin(write=True) as txn:
            for p, j in damaged.items():
                k = records[(p, j)]
                txn.put(k, damage_record(bytes(txn.get(k, db=pages)), rng, in_header=p % 2 == 0), db=pages)
    results, counters, stderr = run(store)
    assert outputs(results) == baseline
    assert counters["tiers"]["L3"]["checksum_failures"] == len(damaged), stderr
    assert stderr.count("rejected") == len(damaged)
    for p, r in enumerate(results):  # the pages before the bad one came from L3, the rest recomputed
        assert r["sources"]["L3"] == damaged[p] * PAGE, (p, damaged[p], r["sources"], r["plan"])
    # The bad records were deleted and the recomputed pages stored in their place.
    assert verify_records(store) == sum(STORED)
    results, counters, _ = run(store)
    assert outputs(results) == baseline
    assert counters["tiers"]["L3"]["checksum_failures"] == 0
    assert [r["sources"]["L3"] for r in results] == [n * PAGE for n in REUSABLE], [r["plan"] for r in results]
    stats = json.loads(kvtier("stats", "--store", str(store), "--json").stdout)
    assert stats["tiers"]["L3"]["checksum_failures"] == len(damaged)


@pytest.mark.parametrize("damage,message", [("garbage-header", "cannot open store at"), ("truncated", "is truncated")])
def test_store_file_damaged_beyond_lmdb_checks_runs_without_l3(tmp_path, baseline, written, damage, message):
    """Garbage over data.mdb's meta pages (LMDB refuses it), or the file cut in half (LMDB
    would open it and die of SIGBUS at the first read past the end: kvtier checks the size)."""
    store = copy_of(written, tmp_path)
    data = store / "data.mdb"
    if damage == "garbage-header":
        with open(data, "r+b") as f:
            f.write(random.Random(1).randbytes(4096))
    else:
        os.truncate(data, data.stat().st_size // 2)
    done = kvtier(*run_args(store))
    results, counters = parse(done)
    line = one_error_line(done)
    assert "running without L3" in line and message in line, line
    assert outputs(results) == baseline
    assert all(r["sources"]["L3"] == 0 for r in results) and "L3" not in counters["tiers"]
    done = kvtier("stats", "--store", str(store))
    assert done.returncode == 2 and message in one_error_line(done)


# --- other format version, other namespace -------------------------------------------------------


def test_other_format_version_is_never_served(tmp_path, baseline, written):
    store = copy_of(written, tmp_path)
    with raw_env(store) as (env, _, meta):
        with env.begin(write=True) as txn:
            txn.put(b"format_version", msgpack.packb(FORMAT_VERSION + 1), db=meta)
    before = snapshot(store)
    message = f"store at {store} has format version {FORMAT_VERSION + 1}, this kvtier reads version {FORMAT_VERSION}"
    done = kvtier(*run_args(store))
    results, counters = parse(done)
    assert one_error_line(done).endswith(f"running without L3: {message}")
    assert outputs(results) == baseline
    assert all(r["sources"]["L3"] == 0 for r in results) and "L3" not in counters["tiers"]
    assert snapshot(store) == before  # neither read nor rewritten
    done = kvtier("stats", "--store", str(store))
    assert done.returncode == 2 and one_error_line(done) == f"kvtier: error: {message}"


def test_other_cache_salt_gets_no_l3_hits(tmp_path, baseline, written):
    store = copy_of(written, tmp_path)
    results, counters, _ = run(store, "--cache-salt", "tenant-b")
    assert outputs(results) == baseline
    assert all(r["sources"]["L3"] == 0 for r in results)
    l3 = counters["tiers"]["L3"]
    assert l3["hit_pages"] == 0 and l3["checksum_failures"] == 0 and l3["inserts"] == sum(STORED)
    results, counters, _ = run(store)  # the first tenant's pages are still there, still its own
    assert outputs(results) == baseline
    assert [r["sources"]["L3"] for r in results] == [n * PAGE for n in REUSABLE]


# --- full and capped tiers -------------------------------------------------------------------------


def test_l3_smaller_than_a_page_drops_and_counts_every_write(tmp_path, baseline):
    results, counters, _ = run(tmp_path / "store", "--l3-bytes", str(PAGE_BYTES // 2))
    assert outputs(results) == baseline
    l3 = counters["tiers"]["L3"]
    assert l3["writes_dropped"] == sum(STORED) and l3["inserts"] == 0 and l3["bytes_used"] == 0


def test_l3_of_a_few_pages_evicts_and_stays_under_its_cap(tmp_path, baseline):
    store = tmp_path / "store"
    cap = 3 * (PAGE_BYTES + 200)
    caps = ["--l1-bytes", str(2 * PAGE_BYTES), "--l2-bytes", str(3 * PAGE_BYTES), "--l3-bytes", str(cap)]
    for _ in range(2):  # the second run restores what is left, and evicts again
        results, counters, _ = run(store, *caps)
        assert outputs(results) == baseline
        tiers = counters["tiers"]
        assert tiers["L3"]["bytes_used"] <= cap and tiers["L3"]["pages"] <= 3
        assert tiers["L1"]["bytes_used"] <= 2 * PAGE_BYTES and tiers["L2"]["bytes_used"] <= 3 * PAGE_BYTES
    assert tiers["L3"]["evictions"] > 0
    stats = json.loads(kvtier("stats", "--store", str(store), "--json").stdout)
    assert stats["tiers"]["L3"]["evictions"] >= sum(STORED) - 3
    assert verify_records(store, cap) <= 3


def test_engine_caps_hold_under_a_long_mixed_workload(tmp_path, loaded):
    """Many requests through the engine API: repeats, shared prefixes, extensions and new
    prompts in bursts; L1 and L2 never exceed their caps after any step."""
    l1, l2 = 3 * PAGE_BYTES, 5 * PAGE_BYTES
    store = StoreConfig(l1_bytes=l1, l2_bytes=l2, l3_bytes=1 << 30, store_dir=tmp_path)
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store))
    rng = random.Random(7)
    bases = [text_prompt(loaded, rng.randint(20, 50), seed=s) for s in range(6)]
    peak = {"L1": 0, "L2": 0}
    step = engine.step

    def checked_step() -> None:
        step()
        tiers = engine.stats().store.tiers
        for name, cap in (("L1", l1), ("L2", l2)):
            assert tiers[name].bytes_used <= cap and tiers[name].pages * PAGE_BYTES <= cap
            peak[name] = max(peak[name], tiers[name].bytes_used)

    engine.step = checked_step
    seen: dict[tuple, list[int]] = {}
    repeats = 0
    for _ in range(12):
        burst = []
        for _ in range(rng.randint(1, 4)):
            base = rng.choice(bases)
            kind = rng.random()
            prompt = base if kind < 0.5 else base + text_prompt(loaded, rng.randint(1, 20), seed=rng.randrange(3))
            burst.append(prompt)
        for prompt, request in zip(burst, engine.generate(burst, SamplingParams(max_tokens=4))):
            repeats += tuple(prompt) in seen
            assert seen.setdefault(tuple(prompt), request.output) == request.output
    stats = engine.stats()
    engine.close()
    assert peak == {"L1": l1, "L2": l2}  # the workload filled both
    assert stats.totals.requests == sum(1 for _ in seen) + repeats
    assert all(stats.store.tiers[t].evictions > 0 for t in ("L1", "L2"))
    assert stats.totals.sources["L1"] > 0 and stats.totals.sources["L2"] > 0
    oracle = Engine(loaded, EngineConfig(page_size=PAGE, offload=False))  # no store at all
    distinct = list(seen)
    for prompt, request in zip(distinct, oracle.generate([list(p) for p in distinct], SamplingParams(max_tokens=4))):
        assert request.output == seen[prompt]
    oracle.close()


# --- several processes on one store -----------------------------------------------------------------


@pytest.mark.parametrize("processes", [2, 4])
def test_concurrent_runs_share_one_store(tmp_path, baseline, processes):
    store = tmp_path / "store"
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "kvtier.engine.cli", *run_args(store)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(processes)
    ]
    done = []
    for c in children:
        out, err = c.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(c.args, c.returncode, out, err))
    for d in done:
        results, _ = parse(d)
        assert outputs(results) == baseline
    stats = json.loads(kvtier("stats", "--store", str(store), "--json").stdout)
    engine, tiers = stats["engine"], stats["tiers"]
    prompt_tokens = sum(len(p) for p in PROMPTS)
    assert engine["requests"] == processes * len(PROMPTS)
    assert engine["prompt_tokens"] == sum(engine["sources"].values()) == processes * prompt_tokens
    assert engine["generated_tokens"] == processes * sum(len(o) for o in baseline)
    for tier in ("L1", "L2", "L3"):  # every restored token was a hit of the tier it came from
        assert tiers.get(tier, {}).get("hit_tokens", 0) == engine["sources"][tier]
    assert tiers["L3"]["inserts"] == tiers["L3"]["pages"] == sum(STORED)  # written once in all
    assert tiers["L3"]["checksum_failures"] == 0
    assert verify_records(store) == sum(STORED)


# --- DESIGN §9, row by row ------------------------------------------------------------------------

BAD_INPUTS = [  # the §9 input rows: arguments (or a prompts file's tokens), and the message
    (["--prompt", ""], "empty prompt"),
    ([1, 2, 999999], "outside the vocabulary"),
    ([5, -1, 7], "outside the vocabulary"),
    (["--prompt", "hi", "--l3-bytes", "12XB"], "bad size"),
    (["--prompt", "hi", "--model", "/no/such/model"], "not an mlx-lm model"),
]


def test_bad_input_is_one_line_exit_2_and_the_store_is_untouched(tmp_path, baseline, written):
    store = copy_of(written, tmp_path)
    before = snapshot(store)
    for args, message in BAD_INPUTS:
        if all(isinstance(a, int) for a in args):
            path = tmp_path / "prompts.jsonl"
            path.write_text(json.dumps({"tokens": args}) + "\n")
            args = ["--prompts-file", str(path)]
        done = kvtier("run", "--store", str(store), "--page-size", str(PAGE), *args)
        assert done.returncode == 2, (args, done.stderr)
        assert message in one_error_line(done), (args, done.stderr)
        after = snapshot(store)
        assert after["records"] == before["records"] and after["meta"] == before["meta"], args
    results, counters, _ = run(store, prompts=PROMPTS[:1])  # the good prompt still restores from L3
    assert outputs(results) == baseline[:1]
    assert results[0]["sources"]["L3"] == REUSABLE[0] * PAGE
    assert counters["tiers"]["L3"]["checksum_failures"] == 0


def test_damaged_store_warns_once_and_runs_without_l3(tmp_path, baseline):
    """A store kvtier cannot open (here: damaged) is one warning and a run without L3; a
    --store that names a file or an unwritable directory is the user's error (exit 2,
    tests/engine/test_store_cli.py)."""
    (tmp_path / "data.mdb").write_bytes(b"this is not lmdb" * 1024)
    results, counters, stderr = run(tmp_path, prompts=PROMPTS[:2])
    assert outputs(results) == baseline[:2]
    assert "running without L3" in stderr and len(stderr.strip().splitlines()) == 1
    assert "L3" not in counters["tiers"]
