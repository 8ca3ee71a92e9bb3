"""`kvtier` as a user runs it: a fresh process per command."""

import json
import re
import subprocess
import sys

import pytest

from .conftest import on_tiny_model

PROMPT = " ".join(["the system prompt of an agent with tools and a long history"] * 8)  # ~500 tokens
PAGE = 128


def kvtier(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "kvtier.engine.cli", *on_tiny_model(args)], capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def run_json(*args: str) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in kvtier("run", "--json", "--max-tokens", "8", *args).stdout.splitlines()]
    return lines[:-1], lines[-1]["counters"]


def test_second_process_restores_from_l3(tmp_path):
    (first,), _ = run_json("--store", str(tmp_path), "--prompt", PROMPT)
    (second,), counters = run_json("--store", str(tmp_path), "--prompt", PROMPT)
    n = second["prompt_tokens"]
    assert first["sources"]["recomputed"] == n
    assert second["sources"]["L3"] >= n - PAGE - 1
    assert second["output_token_ids"] == first["output_token_ids"]
    assert sum(second["sources"].values()) == n
    for key in ("page_size", "model", "text", "ttft_s", "latency_s"):
        assert key in second
    assert counters["tiers"]["L3"]["hit_pages"] == second["sources"]["L3"] // PAGE


def test_sequential_repeat_hits_l1(tmp_path):
    results, _ = run_json("--store", str(tmp_path), "--sequential", "--prompt", PROMPT, "--prompt", PROMPT)
    n = results[1]["prompt_tokens"]
    assert results[1]["sources"]["L1"] >= n - PAGE - 1
    assert results[0]["output_token_ids"] == results[1]["output_token_ids"]


def test_small_l1_spills_to_l2(tmp_path):
    results, counters = run_json("--store", str(tmp_path), "--sequential", "--l1-bytes", "1MiB",
                                 "--prompt", PROMPT, "--prompt", PROMPT)
    assert results[1]["sources"]["L2"] >= results[1]["prompt_tokens"] - PAGE - 1
    assert counters["tiers"]["L1"]["bytes_used"] <= 1 << 20


def test_stats_reads_what_runs_persisted(tmp_path):
    run_json("--store", str(tmp_path), "--prompt", PROMPT)
    run_json("--store", str(tmp_path), "--prompt", PROMPT)
    stats = json.loads(kvtier("stats", "--store", str(tmp_path), "--json").stdout)
    assert stats["engine"]["requests"] == 2
    assert stats["tiers"]["L3"]["pages"] >= 3
    text = kvtier("stats", "--store", str(tmp_path), "--prometheus").stdout
    assert "# TYPE kvtier_tier_pages gauge" in text and 'kvtier_tier_pages{tier="L3"}' in text
    assert re.search(r"# TYPE kvtier_tier_lookups(_total)? counter", text) and 'kvtier_tier_lookups_total{tier="L3"}' in text
    assert re.search(r"# TYPE kvtier_link_bytes(_total)? counter", text)
    assert 'kvtier_source_prompt_tokens_total{source="L3"}' in text


def test_damaged_store_warns_and_runs_without_l3(tmp_path):
    (tmp_path / "data.mdb").write_bytes(b"this is not lmdb" * 1024)
    done = kvtier("run", "--store", str(tmp_path), "--prompt", "hello there", "--max-tokens", "2")
    assert "running without L3" in done.stderr
    assert (tmp_path / "data.mdb").read_bytes() == b"this is not lmdb" * 1024


@pytest.mark.parametrize("content,message", [
    ('{"tokens": [1, 2, 999999]}\n', "outside the vocabulary"),
    ('{"text": "x"}\n', "expected"),
    ("", "holds no prompts"),
])
def test_bad_prompts_file_is_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    done = kvtier("run", "--store", str(tmp_path / "s"), "--prompts-file", str(path), check=False)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_bench_restore_reports_links_limits_peer_and_break_even(tmp_path):
    done = kvtier("bench", "restore", "--json", "--store", str(tmp_path), "--page-size", "16", "--rounds", "2")
    report = json.loads(done.stdout)
    assert report["rounds"] == 2
    links = {row["link"] for row in report["links"]}
    assert links == {"L2->L1", "L3->L1", "L3->L2"}
    for row in report["links"]:
        assert row["bytes"] > 0 and row["gib_s"] > 0 and row["seconds"] > 0
    for link in links:  # pages restored, not bytes over the raw page size (compressed pages are smaller)
        assert [row["pages"] for row in report["links"] if row["link"] == link] == [1, 4, 16, 64]
    rows = {(row["row"], row["pages"]): row for row in report["restores"]}
    assert {name for name, _ in rows} == {"L2->L1", "L3->L1", "L3 zstd->L1"}
    for row in rows.values():  # each figure: the best of the same rounds, and ratios of those bests
        assert len(row["round_seconds"]) == 2 and row["seconds"] == min(row["round_seconds"])
        assert row["ratio_to_memcpy"] == row["memcpy_seconds"] / row["seconds"]
    peer = report["peer"]
    assert len(peer["round_seconds"]) == 2 and peer["load_prompt_cache_seconds"] == min(peer["round_seconds"])
    assert peer["ours_l3_seconds"] == rows["L3->L1", 64]["seconds"]
    assert peer["ratio"] == peer["load_prompt_cache_seconds"] / peer["ours_l3_seconds"]
    assert set(report["break_even_tokens"]) == {"L2", "L3"}
    assert report["limits"]["lmdb_zero_copy_read_gib_s"] > 0
    assert not list(tmp_path.glob("calibration-*")), "the scratch store must be removed"
