"""Trace replay (costmodel/replay.py, on traces read by costmodel/trace.py, beside the
bounds of costmodel/bounds.py): hand-made traces whose numbers are counted by
hand, the bound on the shared Mooncake trace against an independent count, and
`kvtier replay` as a user runs it."""

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.costmodel import bounds as bd
from kvtier.costmodel import replay as rp
from kvtier.costmodel import trace as tr
from kvtier.costmodel.profile import Profile
from kvtier.engine.models.load import load_model

from .. import cli
from ..engine.kind_models import write_model

KV_PER_TOKEN = 12288
PAGE_BYTES = 512 * KV_PER_TOKEN  # 6 MiB


def trace_file(tmp_path: Path, rows: list[tuple[int, int, list[int]]]) -> Path:
    """(input_length, output_length, hash_ids) rows, one second apart."""
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": 1000 * i, "input_length": n, "output_length": out, "hash_ids": ids}) + "\n"
            for i, (n, out, ids) in enumerate(rows)
        )
    )
    return path


# Reusable pages are (n - 1) // 512: 2, 3, 1 and 1.
HAND = [(1100, 10, [1, 2, 3]), (1600, 10, [1, 2, 4, 5]), (1024, 10, [1, 2]), (600, 10, [7, 8])]
HAND_PROMPT = 1100 + 1600 + 1024 + 600
# r1 finds pages 1, 2 (1024 tokens); r2's single reusable page is page 1 (512); r0 and r3 find nothing.
HAND_BOUND = [0, 1024, 512, 0]


def run(trace, page_size=512, **config) -> rp.ReplayResult:
    return rp.Replay(trace, rp.ReplayConfig(KV_PER_TOKEN, page_size, **config), Profile.defaults()).run()


def test_infinite_cache_bound_of_a_hand_made_trace(tmp_path):
    trace = tr.read_trace(trace_file(tmp_path, HAND))
    assert bd.infinite_cache(trace, 512) == HAND_BOUND
    assert bd.infinite_cache(trace, 256) == [0, 1024, 768, 0]  # pages of 256: 4, 6, 3 and 2 reusable
    result = run(trace, l1_bytes=1 << 40)  # unbounded tiers reach the bound exactly
    assert result.reused == HAND_BOUND
    assert result.sources == {"L1": 1536, "L2": 0, "L3": 0, "recomputed": HAND_PROMPT - 1536}


LRU_TRACE = [(1100, 5, [1, 2, 3]), (700, 5, [1, 5]), (600, 5, [7, 8]), (1100, 5, [1, 2, 3])]


def test_lru_hits_with_two_l1_pages(tmp_path):
    """L1 holds two pages, nothing below. r0 publishes 1, 2; r1 uses 1; r2 publishes 7,
    evicting 2 (least recently used; FIFO would evict 1); r3 finds 1, misses 2 and
    publishes it, evicting 7 (1 is pinned)."""
    trace = tr.read_trace(trace_file(tmp_path, LRU_TRACE))
    result = run(trace, l1_bytes=2 * PAGE_BYTES, l2_bytes=0, l3_bytes=0, policy="lru")
    assert bd.infinite_cache(trace, 512) == [0, 512, 0, 1024]
    assert result.reused == [0, 512, 0, 512]
    assert result.evictions["L1"] == 2
    assert result.peak_bytes["L1"] == 2 * PAGE_BYTES


STRANDED = [(1100, 5, [1, 2, 3]), (600, 5, [7, 8]), (1100, 5, [1, 2, 3])]


@pytest.mark.parametrize("policy", ["lru", "cost", "s3fifo"])
def test_leaf_first_evicts_the_page_after_not_the_one_before(tmp_path, policy):
    """L1 holds two pages, nothing below. r0 publishes 1, 2; r1 publishes 7: page 1, the
    oldest, is needed by page 2, so 2 goes (evicting 1 would strand 2: held, never
    usable); r2 reuses page 1 and publishes 2 again, evicting 7 (1 is pinned). At every
    eviction each page held has its previous page held."""
    trace = tr.read_trace(trace_file(tmp_path, STRANDED))
    result = run(trace, l1_bytes=2 * PAGE_BYTES, l2_bytes=0, l3_bytes=0, policy=policy)
    assert result.reused == [0, 0, 512]
    assert (result.held_pages, result.stranded_pages) == (1, 0)
    report = result.report(distinct_pages=3)
    assert (report["unreachable_ratio"], report["unreachable_at_eviction"]) == (0.0, 0.0)
    assert result.evictions["L1"] == 2 and result.peak_bytes["L1"] <= 2 * PAGE_BYTES


def test_each_policy_is_reported_against_the_bound_and_belady_at_its_caps(tmp_path):
    """One L1 page, nothing below: Belady keeps page 1 for r1 and r3 (1024 tokens, under
    the bound's 1536); LRU keeps page 1 when r0's page 2 comes (leaf-first: 2 is dropped),
    so r1 reuses it, then keeps whatever came last (512 tokens in all)."""
    trace = tr.read_trace(trace_file(tmp_path, LRU_TRACE))
    base = rp.ReplayConfig(KV_PER_TOKEN, l1_bytes=PAGE_BYTES, l2_bytes=0, l3_bytes=0)
    report = rp.replay(trace, rp.configs_for(base, ["lru", "belady"], ["always"]), Profile.defaults())
    lru, offline = report["policies"]
    prompt = sum(n for n, _, _ in LRU_TRACE)
    assert (lru["reused_tokens"], offline["reused_tokens"]) == (512, 1024)
    assert lru["bound_gap_points"] == pytest.approx(100 * (1536 - 512) / prompt)
    assert lru["belady_gap_points"] == pytest.approx(100 * (1024 - 512) / prompt)


REPEAT = [(1100, 5, [1, 2, 3])] * 3  # two reusable pages, asked three times


def test_spill_to_l3_is_written_once(tmp_path):
    """L1 holds one page, no L2: r0's page 1 goes to L3 when page 2 arrives; r1 and r2
    restore page 1 from L3 and page 2 from L1 and publish nothing: one page written."""
    trace = tr.read_trace(trace_file(tmp_path, REPEAT))
    result = run(trace, l1_bytes=PAGE_BYTES, l2_bytes=0, l3_bytes=8 * PAGE_BYTES)
    report = result.report(distinct_pages=2)
    assert result.reused == [0, 1024, 1024]
    assert report["sources"] == {"L1": 1024, "L2": 0, "L3": 1024, "recomputed": 3300 - 2048}
    assert report["l3_bytes_written"] == PAGE_BYTES
    assert report["l3_bytes_per_day"] == pytest.approx(PAGE_BYTES * 86400 / 2)  # arrivals 0 s .. 2 s
    later = [replace(r, arrival_s=r.arrival_s + 3600) for r in trace]  # the same two seconds, an hour on
    assert (
        run(later, l1_bytes=PAGE_BYTES, l2_bytes=0, l3_bytes=8 * PAGE_BYTES).report(2)["l3_bytes_per_day"]
        == (report["l3_bytes_per_day"])
    )
    assert report["link_bytes"]["L1->L3"] == PAGE_BYTES
    assert report["link_bytes"]["L3->L1"] == 2 * PAGE_BYTES
    assert report["l3_write_amplification"] == 0.5


def test_second_use_admission_writes_after_the_second_sighting(tmp_path):
    """r0: page 2 finds L1 holding page 1, which it needs (leaf-first), and goes below,
    seen once: not written. r1 reuses 1 (seen twice) and recomputes 2 (seen twice),
    which goes below again, admitted. r2 reuses both."""
    trace = tr.read_trace(trace_file(tmp_path, REPEAT))
    result = run(trace, l1_bytes=PAGE_BYTES, l2_bytes=0, l3_bytes=8 * PAGE_BYTES, l3_admit="second-use")
    assert result.reused == [0, 512, 1024]
    assert result.l3_pages_written == 1
    assert result.l3_writes_refused == 1


def test_decode_seconds_is_the_sum_of_one_token_steps():
    profile = Profile.defaults()
    profile.compute.coef = [1e-3, 2e-3, 1e-6]
    steps = sum(profile.compute.predict(1, p) for p in range(100, 105))
    assert rp.decode_seconds(profile.compute, 100, 5) == pytest.approx(steps)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [1]}', "1 hash_ids for 700 tokens"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length >= 1"),
        ('{"timestamp": 0}', "not a trace request"),
        ("not json", "not a trace request"),
    ],
)
def test_a_bad_trace_line_is_one_clear_error(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(tr.TraceError, match=message):
        tr.read_trace(path)


def shared_trace() -> Path | None:
    for root in Path(__file__).resolve().parents:
        path = root / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
        if path.exists():
            return path
    return None


SHARED = shared_trace()
needs_shared = pytest.mark.skipif(SHARED is None, reason="shared Mooncake trace not found")


@needs_shared
def test_bound_on_the_shared_trace_equals_an_independent_count():
    seen, reused = set(), 0
    for line in SHARED.read_text().splitlines():
        r = json.loads(line)
        usable = (r["input_length"] - 1) // 512
        hits = 0
        while hits < usable and r["hash_ids"][hits] in seen:
            hits += 1
        reused += 512 * hits
        seen.update(r["hash_ids"][:usable])
    assert sum(bd.infinite_cache(tr.read_trace(SHARED), 512)) == reused


@needs_shared
@pytest.mark.parametrize("policy, admit", [("lru", "always"), ("cost", "always"), ("cost", "second-use")])
def test_policies_stay_under_the_bound_and_the_caps(policy, admit):
    trace = tr.read_trace(SHARED)[:150]
    bound = bd.infinite_cache(trace, 128)
    result = run(
        trace,
        page_size=128,
        l1_bytes=64 * PAGE_BYTES // 4,
        l2_bytes=64 * PAGE_BYTES // 4,
        l3_bytes=32 * PAGE_BYTES // 4,
        policy=policy,
        l3_admit=admit,
    )
    assert all(r <= b for r, b in zip(result.reused, bound))
    assert sum(result.reused) > 0
    assert all(result.peak_bytes[t] <= result.capacity[t] for t in ("L1", "L2", "L3"))
    assert result.evictions["L3"] > 0  # the caps were reached


def kvtier(*args: str) -> subprocess.CompletedProcess:
    return cli.run(args)


def test_cli_replay_json_reports_bound_and_each_policy(tmp_path):
    done = kvtier(
        "replay",
        str(trace_file(tmp_path, HAND)),
        "--kv-bytes-per-token",
        str(KV_PER_TOKEN),
        "--l1-bytes",
        "1TiB",
        "--policy",
        "lru,cost",
        "--l3-admit",
        "always,second-use",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["infinite_cache"]["reused_tokens"] == sum(HAND_BOUND)
    assert [p["policy"] for p in report["policies"]] == ["lru", "lru+second-use", "cost", "cost+second-use"]
    assert all(p["reused_tokens"] == sum(HAND_BOUND) for p in report["policies"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--page-size", "384"], "does not divide 512"),
        (["--policy", "mru"], "bad choice 'mru'"),
        (["--sweep", "l1-bytes=1GiB"], "bad sweep"),
        (["--plot", "x.png"], "give --sweep"),
        (["--profile", "missing.json"], "cannot read profile"),
        (["--l3-write-budget", "5GiB"], "bad rate '5GiB'"),
        (["--l3-write-budget", "none,0GiB/day"], "bad rate '0GiB/day'"),
    ],
)
def test_cli_replay_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    done = kvtier("replay", str(trace_file(tmp_path, HAND)), "--kv-bytes-per-token", "8", *args)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_cli_replay_plots_a_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sizing.png"
    done = kvtier(
        "replay",
        str(trace_file(tmp_path, HAND)),
        "--kv-bytes-per-token",
        str(KV_PER_TOKEN),
        "--policy",
        "lru,belady",
        "--sweep",
        "l2-bytes=6MiB,1GiB",
        "--l1-bytes",
        "0",
        "--plot",
        str(plot),
    )
    assert done.returncode == 0, done.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [line.split()[0] for line in done.stdout.splitlines()[4:]]  # after the header
    assert rows == ["lru", "belady", "lru", "belady"]


def test_belady_keeps_the_page_used_soonest(tmp_path):
    """Two pages of room: r1's page 5 is used again later than pages 1, 2, so it goes;
    r2 reuses 1, 2 (then never used again, they go); r3 misses 5. Three pages: all reuse.
    LRU (leaf-first) lets page 2 go for 5, and 5 for 2 at r2: r2 reuses page 1 only."""
    trace = tr.read_trace(trace_file(tmp_path, [(1100, 1, [1, 2, 3]), (600, 1, [5, 6])] * 2))
    assert bd.belady(trace, 512, 2) == [0, 0, 1024, 0]
    assert bd.belady(trace, 512, 3) == [0, 0, 1024, 512] == bd.infinite_cache(trace, 512)
    lru = run(trace, l1_bytes=2 * PAGE_BYTES, l2_bytes=0, l3_bytes=0, policy="lru")
    assert lru.reused == [0, 0, 512, 0]


STATE_BYTES = 1 << 20  # a hybrid model's snapshot
# Snapshots every 2 pages and after the last full page (4). r1 shares 3 pages with r0 but
# a state exists only after page 2; r2 repeats r0 and finds the state after its page 4.
HYBRID = [(2049, 4, [1, 2, 3, 4, 5]), (2049, 4, [1, 2, 3, 9, 10]), (2049, 4, [1, 2, 3, 4, 5])]


def test_a_hybrid_replay_restores_up_to_snapshots_and_counts_their_bytes(tmp_path):
    trace = tr.read_trace(trace_file(tmp_path, HYBRID))
    caps = {"l1_bytes": 2 * PAGE_BYTES, "l2_bytes": 2 * PAGE_BYTES, "snapshot_spacing": 2}
    snapshot_caps = {"snapshot_l1_bytes": STATE_BYTES, "snapshot_l2_bytes": STATE_BYTES}  # one each: some go to L3
    hybrid = rp.ReplayConfig(KV_PER_TOKEN, 512, snapshot_bytes=STATE_BYTES, **caps, **snapshot_caps)
    assert run(trace, **caps).reused == bd.infinite_cache(trace, 512) == [0, 1536, 2048]
    result = rp.Replay(trace, hybrid, Profile.defaults()).run()
    assert result.reused == bd.infinite_cache(trace, 512, hybrid.snapshot_points(Profile.defaults())) == [0, 1024, 2048]
    report = result.report(distinct_pages=6)
    snapshots = report["snapshot_link_bytes"]
    assert report["snapshot_bytes"] == STATE_BYTES and snapshots["L3->L1"] > 0, "a snapshot read back from L3"
    for link, total in report["link_bytes"].items():  # pages and snapshots, each at its size
        assert snapshots[link] % STATE_BYTES == 0 and (total - snapshots[link]) % PAGE_BYTES == 0, link
    assert result.l3_snapshots_written > 0 and result.l3_pages_written > 0
    written = result.l3_pages_written * PAGE_BYTES + result.l3_snapshots_written * STATE_BYTES
    assert report["l3_bytes_written"] == written


def test_cli_replay_of_a_hybrid_geometry(tmp_path):
    trace = str(trace_file(tmp_path, HYBRID))
    common = ["replay", trace, "--policy", "lru", "--l1-bytes", "1TiB", "--json"]
    done = kvtier(*common, "--kv-bytes-per-token", str(KV_PER_TOKEN), "--state-bytes", "1MiB")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    (row,) = report["policies"]
    assert row["snapshot_bytes"] == STATE_BYTES and report["infinite_cache"]["reused_tokens"] == row["reused_tokens"]
    model = write_model(tmp_path / "lfm2", "lfm2")
    done = kvtier(*common, "--model", str(model), "--page-size", "256", "--store", str(tmp_path / "store"))
    assert done.returncode == 0, done.stderr
    expected = load_model(str(model)).geometry(256).snapshot_nbytes
    assert json.loads(done.stdout)["policies"][0]["snapshot_bytes"] == expected > 0
    refused = kvtier(*common, "--model", str(model), "--state-bytes", "1MiB")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "kvtier: error: --state-bytes goes with --kv-bytes-per-token (a --model's state size is its own)"
    )


SCAN = [(1100, 5, [1, 2, 3]), (1100, 5, [1, 2, 4]), (12 * 512 + 1, 5, list(range(100, 113))), (1100, 5, [1, 2, 5])]


def test_a_scan_of_one_hit_pages_does_not_evict_a_reused_prefix_under_s3fifo(tmp_path):
    """L1 holds four pages, nothing below. r1 reuses r0's pages 1, 2; r2 publishes twelve
    pages never seen again. Under lru they push 1, 2 out; under s3fifo they pass through
    the small queue while 1, 2, used, move to the main one: r3 reuses them."""
    trace = tr.read_trace(trace_file(tmp_path, SCAN))
    reused = {}
    for policy in ("lru", "s3fifo"):
        result = run(trace, l1_bytes=4 * PAGE_BYTES, l2_bytes=0, l3_bytes=0, policy=policy)
        assert result.peak_bytes["L1"] <= 4 * PAGE_BYTES
        reused[policy] = result.reused
    assert reused == {"lru": [0, 1024, 0, 0], "s3fifo": [0, 1024, 0, 1024]}


# A 4-page prefix shared by ten requests, each with a 3-page tail of its own (7 reusable pages).
SHARED_PREFIX = [(7 * 512 + 1, 5, [1, 2, 3, 4, 100 + 3 * r, 101 + 3 * r, 102 + 3 * r, 999]) for r in range(10)]


@pytest.mark.parametrize("policy", ["lru", "cost", "s3fifo"])
@pytest.mark.parametrize("l1_pages, l2_pages", [(6, 0), (1, 6)])
def test_leaf_first_keeps_a_long_shared_prefix_under_many_tails(tmp_path, policy, l1_pages, l2_pages):
    """Six pages in L1, or one in L1 and six in L2, nothing below: a request's prefix and
    tail do not fit. Each tail page leaves before the prefix pages it needs (a new tail
    page never pushes out the page before it), so every request after the first reuses
    the whole prefix."""
    trace = tr.read_trace(trace_file(tmp_path, SHARED_PREFIX))
    caps = {"l1_bytes": l1_pages * PAGE_BYTES, "l2_bytes": l2_pages * PAGE_BYTES}
    result = run(trace, l3_bytes=0, policy=policy, **caps)
    assert result.reused == [0] + [4 * 512] * 9
    assert result.report(distinct_pages=34)["unreachable_at_eviction"] == 0.0
    assert result.peak_bytes["L1"] <= caps["l1_bytes"] and result.peak_bytes["L2"] <= caps["l2_bytes"]


@pytest.mark.parametrize("policy", ["lru", "cost"])
def test_l3_keeps_a_long_shared_prefix_under_many_tails(tmp_path, policy):
    """One page in L1, none in L2, six in L3: the prefix lives in L3, and every tail
    page written there after it follows a prefix page, so L3 evicts tails only (a
    tail's first page leaves after its last) and every request after the first
    reuses the whole prefix."""
    trace = tr.read_trace(trace_file(tmp_path, SHARED_PREFIX))
    result = run(trace, l1_bytes=PAGE_BYTES, l2_bytes=0, l3_bytes=6 * PAGE_BYTES, policy=policy)
    assert result.reused == [0] + [4 * 512] * 9
    assert result.evictions["L3"] > 0 and result.peak_bytes["L3"] <= 6 * PAGE_BYTES
