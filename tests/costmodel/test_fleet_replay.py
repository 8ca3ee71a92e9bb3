"""The fleet replay (costmodel/fleet_replay.py, ``kvtier replay --engines``) on hand-made
traces: engines share one L3, cache-aware routing reuses more than round-robin, least
load spreads a burst evenly, and every count adds up."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.costmodel import fleet_replay as fr
from kvtier.costmodel import trace as tr
from kvtier.costmodel.profile import Profile
from kvtier.costmodel.replay import ReplayConfig

from .test_replay import KV_PER_TOKEN, PAGE_BYTES, kvtier

PAGE = 512


def write_trace(tmp_path: Path, rows: list[tuple[float, int, list[int]]]) -> Path:
    """(arrival seconds, input_length, hash_ids) rows, 10 output tokens each."""
    path = tmp_path / "fleet.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": 1000 * t, "input_length": n, "output_length": 10, "hash_ids": ids}) + "\n"
            for t, n, ids in rows
        )
    )
    return path


def conversations(talks: int, turns: int, gap_s: float = 100.0) -> list[tuple[float, int, list[int]]]:
    """``talks`` conversations of ``turns`` turns, interleaved: turn k of a conversation is
    its first k + 1 blocks (its own ids) and 100 tokens of a block of that turn's, so each
    turn's k + 1 reusable pages start with the last turn's k. ``gap_s`` apart: an engine
    is idle when the next comes."""
    rows = []
    for turn in range(turns):
        for talk in range(talks):
            blocks = [100 * talk + b for b in range(turn + 1)] + [100 * talk + 50 + turn]
            rows.append((gap_s * len(rows), PAGE * (turn + 1) + 100, blocks))
    return rows


def config(**caps: int) -> ReplayConfig:
    return ReplayConfig(KV_PER_TOKEN, PAGE, **{"l1_bytes": 64 * PAGE_BYTES, "l2_bytes": 0, **caps})


def fleet(tmp_path: Path, rows, engines: int, route: str, **caps: int) -> dict:
    trace = tr.read_trace(write_trace(tmp_path, rows))
    return fr.replay_fleet(trace, config(**caps), Profile.defaults(), engines, route)


BUSY_GAP_S = 0.3  # requests come faster than one engine serves them: both engines are needed


@pytest.fixture
def talks(tmp_path):
    """Three conversations of five turns on two busy engines: round-robin sends each turn
    to the other engine than its last one (three conversations, two engines)."""
    return {route: fleet(tmp_path, conversations(3, 5, BUSY_GAP_S), 2, route) for route in fr.ROUTES}


def test_cache_aware_reuses_more_than_round_robin_and_still_spreads(talks):
    aware, robin = talks["cache-aware"], talks["round-robin"]
    assert robin["reused_tokens"] < aware["reused_tokens"] <= 3 * (1 + 2 + 3 + 4) * PAGE  # the bound: each turn
    assert aware["prefill_seconds_saved"] > robin["prefill_seconds_saved"]
    assert aware["ttft_p50_s"] < robin["ttft_p50_s"]
    assert min(e["requests"] for e in aware["per_engine"].values()) >= 5  # not all on one engine


def test_on_idle_engines_cache_aware_reuses_every_last_turn(tmp_path):
    row = fleet(tmp_path, conversations(3, 5), 2, "cache-aware")
    assert row["reused_tokens"] == 3 * (1 + 2 + 3 + 4) * PAGE


@pytest.mark.parametrize("route", fr.ROUTES)
def test_the_counts_add_up(talks, route):
    row, rows = talks[route], conversations(3, 5, BUSY_GAP_S)
    prompt = sum(n for _, n, _ in rows)
    assert row["requests"] == len(rows) == sum(e["requests"] for e in row["per_engine"].values())
    assert row["prompt_tokens"] == prompt == sum(e["prompt_tokens"] for e in row["per_engine"].values())
    assert sum(row["sources"].values()) == prompt
    assert row["reused_tokens"] == prompt - row["sources"]["recomputed"]
    assert row["reused_ratio"] == pytest.approx(row["reused_tokens"] / prompt)
    assert row["ttft_p50_s"] <= row["ttft_p95_s"] <= row["ttft_p99_s"]
    requests = [e["requests"] for e in row["per_engine"].values()]
    assert row["requests_spread"] == pytest.approx(max(requests) / (sum(requests) / len(requests)))


def test_least_load_spreads_a_burst_evenly(tmp_path):
    rows = [(0.0, 2 * PAGE + 100, [500 + i, 600 + i, 700 + i]) for i in range(12)]  # all at once, nothing shared
    row = fleet(tmp_path, rows, 3, "least-load")
    assert [e["requests"] for e in row["per_engine"].values()] == [4, 4, 4]
    assert row["requests_spread"] == row["prompt_tokens_spread"] == pytest.approx(1.0)


@pytest.mark.parametrize("route", ["least-load", "cache-aware"])
def test_ties_take_turns(tmp_path, route):
    """Each request finds every engine idle (they are far apart) and none holding its
    pages: the tie between them goes to each engine in turn, not always to the first."""
    rows = [(100.0 * i, 2 * PAGE + 100, [500 + i, 600 + i, 700 + i]) for i in range(12)]
    row = fleet(tmp_path, rows, 3, route)
    assert [e["requests"] for e in row["per_engine"].values()] == [4, 4, 4]


def test_a_page_one_engine_spilled_is_found_by_another(tmp_path):
    """L1 holds two pages and there is no L2: a page leaving an engine's L1 goes to the
    shared L3. e0 computes pages 1, 2 (r0), then 10..12 (r2), which evict 1, 2 to L3;
    r3 on e1 finds 1, 2 there."""
    rows = [(0, 1100, [1, 2, 3]), (100, 1600, [7, 8, 9, 6]), (200, 1600, [10, 11, 12, 13]), (300, 1100, [1, 2, 3])]
    row = fleet(tmp_path, rows, 2, "round-robin", l1_bytes=2 * PAGE_BYTES, l3_bytes=64 * PAGE_BYTES)
    assert row["sources"]["L3"] == 2 * PAGE
    assert row["sources"]["L1"] == 0


@pytest.mark.parametrize("through", [False, True])
def test_with_write_through_a_page_another_engine_still_holds_in_l1_is_found_in_l3(tmp_path, through):
    """Room in every L1 and no L2: nothing spills. Written back, e1 recomputes the prompt
    e0 served; written through, e1 restores its two pages from the shared L3."""
    rows = [(0, 1100, [1, 2, 3]), (100, 1100, [1, 2, 3])]
    trace = tr.read_trace(write_trace(tmp_path, rows))
    one = replace(config(), l3_write_through=through)
    row = fr.replay_fleet(trace, one, Profile.defaults(), 2, "round-robin")
    assert row["l3_write_through"] is through
    assert row["sources"]["L3"] == (2 * PAGE if through else 0) and row["sources"]["L1"] == 0


def test_cli_replay_engines_with_write_through_reports_each_route_both_ways(tmp_path):
    path = write_trace(tmp_path, conversations(3, 3))
    args = ("replay", str(path), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--l2-bytes", "0", "--engines", "2")
    done = kvtier(*args, "--route", "round-robin", "--l3-write-through", "--json")
    assert done.returncode == 0, done.stderr
    back, through = json.loads(done.stdout)["routes"]
    assert (back["l3_write_through"], through["l3_write_through"]) == (False, True)
    assert through["sources"]["L3"] > back["sources"]["L3"]  # round-robin sends each turn to the other engine
    text = kvtier(*args, "--route", "round-robin", "--l3-write-through")
    assert [row.split()[0] for row in text.stdout.splitlines()[-2:]] == ["round-robin", "round-robin+through"]


def test_cli_replay_engines_reports_each_route(tmp_path):
    path = write_trace(tmp_path, conversations(3, 3))
    args = ("replay", str(path), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--l2-bytes", "0", "--engines", "2")
    done = kvtier(*args, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["engines"], report["requests"], report["max_imbalance"]) == (2, 9, fr.MAX_IMBALANCE)
    assert [r["route"] for r in report["routes"]] == list(fr.ROUTES)
    admit = kvtier(*args, "--policy", "lru", "--l3-admit", "second-use", "--route", "round-robin", "--json")
    assert json.loads(admit.stdout)["policy"] == "lru+second-use"
    text = kvtier(
        "replay", str(path), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engines", "2", "--route", "least-load"
    )
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[-1].split()[0] == "least-load"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--route", "cache-aware"], "--route goes with --engines"),
        (["--max-imbalance", "2"], "--max-imbalance goes with --engines"),
        (["--engines", "2", "--route", "random"], "bad choice 'random'"),
        (["--engines", "0"], "--engines"),
        (["--engines", "2", "--policy", "lru,cost"], "one --policy"),
        (["--engines", "2", "--sweep", "l2-bytes=1GiB"], "--sweep does not go with it"),
        (["--l3-write-through"], "--l3-write-through goes with --engines"),
        (["--engines", "2", "--l3-write-through", "--l3-write-budget", "1GiB/h"], "exclude each other"),
    ],
)
def test_cli_fleet_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    path = write_trace(tmp_path, conversations(1, 1))
    done = kvtier("replay", str(path), "--kv-bytes-per-token", "8", *args)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
