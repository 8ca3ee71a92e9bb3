"""L3 writes under a budget (tiers/write_budget.py, ``--l3-write-budget``): a token bucket
on the store's clock that admits pages by their expected saving, on hand-made pages and
a hand-made trace whose spill the budget binds."""

import json
from pathlib import Path

from kvtier.costmodel import replay as rp
from kvtier.costmodel import trace as tr
from kvtier.costmodel.profile import Profile
from kvtier.tiers.write_budget import BURST_S, WriteBudget

KV_PER_TOKEN = 12288
PAGE_BYTES = 512 * KV_PER_TOKEN


def test_a_draining_bucket_writes_the_pages_worth_most():
    """Pages worth 1 and 10 alternate at one moment: the bucket (six pages) is spent
    mostly on the pages worth 10, and a page's bytes are only charged when written;
    a minute later it has refilled by the rate and writes again."""
    now = [0.0]
    assert WriteBudget(1.0, 1000, lambda: now[0]).capacity == 1000  # at least a page, else nothing is written
    budget = WriteBudget(6000 / BURST_S, 1000, lambda: now[0])  # 6 pages of 1000 bytes a minute
    written = {1.0: 0, 10.0: 0}
    for i in range(40):
        saving = 10.0 if i % 2 else 1.0
        written[saving] += budget.admits(WriteBudget.worth(3, saving))
    assert sum(written.values()) <= 6 and written[10.0] > written[1.0] >= 1
    assert budget.skipped == 40 - sum(written.values())
    now[0] = BURST_S  # a minute on: the bucket is full again
    again = sum(budget.admits(WriteBudget.worth(3, 10.0)) for _ in range(40))
    assert 1 <= again <= 6


def test_a_shallower_page_is_worth_more_whatever_it_saves():
    """A page one into its chain and one four pages deeper alternate, the deep one worth
    ten times more on its own: every reuse of the deep one needs the shallow ones before
    it, so the draining bucket is spent on the shallow pages."""
    budget = WriteBudget(6000 / BURST_S, 1000, lambda: 0.0)
    written = {1: 0, 5: 0}
    for i in range(40):
        depth = 5 if i % 2 else 1
        written[depth] += budget.admits(WriteBudget.worth(depth, 10.0 if depth == 5 else 1.0))
    assert written[1] > written[5]


def test_a_page_is_written_only_with_room_left_for_the_pages_before_it():
    """Pages leave leaf-first, so a chain's pages ask deepest first. With two pages left in
    the bucket and the recent pages deeper still (every page of the chain ranks high), a
    page three pages in would take what its three predecessors need and be stranded:
    the bucket writes the chain's first two pages instead, a start of it."""
    budget = WriteBudget(6000 / BURST_S, 1000, lambda: 0.0)  # six pages
    assert all(budget.admits(WriteBudget.worth(0, 1.0)) for _ in range(4))  # two pages left
    assert not any(budget.admits(WriteBudget.worth(20, 1.0)) for _ in range(20))  # deeper than the bucket holds
    written = [depth for depth in (3, 2, 1, 0) if budget.admits(WriteBudget.worth(depth, 1.0))]
    assert written == [1, 0]


def trace_file(tmp_path: Path, rows: list[list[int]]) -> Path:
    """Requests of 2 new pages and 10 tokens (hash_ids given), one second apart."""
    path = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"timestamp": 1000 * i, "input_length": 1100, "output_length": 5, "hash_ids": ids}) + "\n"
        for i, ids in enumerate(rows)
    ]
    path.write_text("".join(lines))
    return path


def test_the_budget_binds_a_replays_spill(tmp_path):
    """One L1 page, no L2: every page but the newest goes to L3, 60 pages in 30 s. At a
    page every 10 s of the trace's time (a bucket of 6), at most 6 + 3 are written and
    the rest are counted as over the budget; unbudgeted, every one is written. The
    caps hold throughout, and the bytes per day say the budget's rate at most."""
    trace = tr.read_trace(trace_file(tmp_path, [[2 * i, 2 * i + 1, 10**6 + i] for i in range(31)]))
    caps = {"l1_bytes": PAGE_BYTES, "l2_bytes": 0, "l3_bytes": 100 * PAGE_BYTES}
    rate = PAGE_BYTES / 10
    config = rp.ReplayConfig(KV_PER_TOKEN, policy="cost", **caps)
    free = rp.Replay(trace, config, Profile.defaults()).run()
    budget = rp.Replay(trace, rp.replace(config, l3_write_budget=rate), Profile.defaults()).run()
    assert free.l3_pages_written == 61 and free.l3_writes_over_budget == 0
    assert budget.l3_pages_written <= 6 + 30 / 10 and budget.l3_pages_written >= 6
    assert budget.l3_pages_written + budget.l3_writes_over_budget == free.l3_pages_written
    report = budget.report(distinct_pages=62)
    assert report["policy"] == "cost+budget" and report["l3_write_budget_bytes_per_day"] == rate * 86400
    assert report["l3_bytes_written"] <= rate * budget.trace_s + BURST_S * rate
    assert all(budget.peak_bytes[t] <= budget.capacity[t] for t in budget.capacity)


def test_what_the_budget_writes_of_a_chain_is_its_start(tmp_path):
    """Thirty four-page prompts, then the same thirty again: one L1 page, no L2, a page
    of L3 writes every 10 s. Pages leave L1 last page first (leaf-first); the budget
    ranks a shallower page first, so of each chain it writes a start, never pages after
    one it refused: the second pass finds no page stranded (held after a missing one)."""
    chains = [[10 * i + j for j in range(5)] for i in range(30)]  # 4 reusable pages of 2100 tokens
    rows = [
        {"timestamp": 1000 * t, "input_length": 2100, "output_length": 5, "hash_ids": ids}
        for t, ids in enumerate(chains + chains)
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = rp.ReplayConfig(KV_PER_TOKEN, l1_bytes=PAGE_BYTES, l2_bytes=0, l3_bytes=200 * PAGE_BYTES)
    result = rp.Replay(
        tr.read_trace(path), rp.replace(config, l3_write_budget=PAGE_BYTES / 10), Profile.defaults()
    ).run()
    assert result.l3_writes_over_budget > 0 and result.l3_pages_written > 0
    assert sum(result.reused) > 0 and result.stranded_pages == 0
