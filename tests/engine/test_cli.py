"""`kvtier` as a user runs it: a fresh process per command."""

import json
import re
import subprocess

import pytest

from kvtier.costmodel import bandwidth

from .. import cli
from ..redis_servers import needs_redis, redis_server  # noqa: F401
from .conftest import on_tiny_model

pytestmark = pytest.mark.slow  # starts processes or loads the real model

PROMPT = " ".join(["the system prompt of an agent with tools and a long history"] * 8)  # ~500 tokens
PAGE = 128


def kvtier(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = cli.run(on_tiny_model(args))
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
    results, counters = run_json(
        "--store", str(tmp_path), "--sequential", "--l1-bytes", "1MiB", "--prompt", PROMPT, "--prompt", PROMPT
    )
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
    assert (
        re.search(r"# TYPE kvtier_tier_lookups(_total)? counter", text)
        and 'kvtier_tier_lookups_total{tier="L3"}' in text
    )
    assert re.search(r"# TYPE kvtier_link_bytes(_total)? counter", text)
    assert 'kvtier_prompt_tokens_total{source="L3"}' in text


def test_damaged_store_warns_and_runs_without_l3(tmp_path):
    (tmp_path / "data.mdb").write_bytes(b"this is not lmdb" * 1024)
    done = kvtier("run", "--store", str(tmp_path), "--prompt", "hello there", "--max-tokens", "2")
    assert "running without L3" in done.stderr
    assert (tmp_path / "data.mdb").read_bytes() == b"this is not lmdb" * 1024


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"tokens": [1, 2, 999999]}\n', "outside the vocabulary"),
        ('{"text": "x"}\n', "expected"),
        ("", "holds no prompts"),
    ],
)
def test_bad_prompts_file_is_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    done = kvtier("run", "--store", str(tmp_path / "s"), "--prompts-file", str(path), check=False)
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_bench_restore_reports_links_limits_peer_and_break_even(tmp_path):
    """``--quick`` (its page counts, rounds and prefill grid; the full run differs only in
    those constants and takes minutes)."""
    done = kvtier("bench", "restore", "--quick", "--json", "--store", str(tmp_path), "--page-size", "16")
    report = json.loads(done.stdout)
    assert report["rounds"] == bandwidth.QUICK_ROUNDS == 2
    links = {row["link"] for row in report["links"]}
    assert links == {"L2->L1", "L3->L1", "L3->L2"}
    for row in report["links"]:
        assert row["bytes"] > 0 and row["gib_s"] > 0 and row["seconds"] > 0
    for link in links:  # pages restored, not bytes over the raw page size (compressed pages are smaller)
        assert [row["pages"] for row in report["links"] if row["link"] == link] == list(bandwidth.QUICK_PAGE_COUNTS)
    rows = {(row["row"], row["pages"]): row for row in report["restores"]}
    assert {name for name, _ in rows} == {"L2->L1", "L3->L1", "L3 zstd->L1"}
    for row in rows.values():  # each figure: the best of the same rounds, and ratios of those bests
        assert len(row["round_seconds"]) == 2 and row["seconds"] == min(row["round_seconds"])
        assert row["ratio_to_memcpy"] == row["memcpy_seconds"] / row["seconds"]
    peer = report["peer"]
    assert len(peer["round_seconds"]) == 2 and peer["load_prompt_cache_seconds"] == min(peer["round_seconds"])
    assert peer["ours_l3_seconds"] == rows["L3->L1", max(bandwidth.QUICK_PAGE_COUNTS)]["seconds"]
    assert peer["ratio"] == peer["load_prompt_cache_seconds"] / peer["ours_l3_seconds"]
    assert set(report["break_even_tokens"]) == {"L2", "L3"}
    assert report["limits"]["lmdb_zero_copy_read_gib_s"] > 0
    assert not list(tmp_path.glob("calibration-*")), "the scratch store must be removed"


TTFT_PAGE, TTFT_LENGTHS = 64, (150, 300)


@pytest.fixture(scope="module")
def ttft_bench(tmp_path_factory):
    """One ``bench ttft`` run on the tiny model (with a plot where matplotlib is installed)."""
    import importlib.util

    directory = tmp_path_factory.mktemp("ttft")
    plot = directory / "ttft.png"
    args = [
        "bench",
        "ttft",
        "--json",
        "--store",
        str(directory),
        "--page-size",
        str(TTFT_PAGE),
        "--lengths",
        ",".join(map(str, TTFT_LENGTHS)),
    ]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plot", str(plot)]
    return json.loads(kvtier(*args).stdout), directory, plot


def restored_from(tier: str, n: int) -> dict:
    """The sources of an ``n``-token run whose every reusable page came from ``tier``."""
    restored = (n - 1) // TTFT_PAGE * TTFT_PAGE
    return {"L1": 0, "L2": 0, "L3": 0, tier: restored, "recomputed": n - restored}


def test_bench_ttft_times_every_source_from_the_tier_it_names(ttft_bench):
    report, directory, _ = ttft_bench
    assert report["sources"] == ["recompute", "L1", "L2", "L3"] and report["rounds"] == 1
    assert [row["prompt_tokens"] for row in report["rows"]] == list(TTFT_LENGTHS)
    for row in report["rows"]:
        n = row["prompt_tokens"]
        assert row["restored_tokens"] == (n - 1) // TTFT_PAGE * TTFT_PAGE
        assert set(row["ttft_s"]) == set(report["sources"]) and min(row["ttft_s"].values()) > 0
        for tier in ("L1", "L2", "L3"):
            assert row["ratio_to_recompute"][tier] == pytest.approx(
                row["ttft_s"][tier] / row["ttft_s"]["recompute"], abs=5e-5
            )  # rounded to 4 places
        for tier in ("L2", "L3"):
            assert row["sources"][tier] == restored_from(tier, n)
        assert row["sources"]["L1"] == {"L1": n - 1, "L2": 0, "L3": 0, "recomputed": 1}  # with its last partial page
        assert row["sources"]["recompute"] == {"L1": 0, "L2": 0, "L3": 0, "recomputed": n}
    assert set(report["break_even_tokens"]) == {"L1", "L2", "L3"}
    assert [p.name for p in directory.iterdir() if p.name != "ttft.png"] == [], "the scratch store must be removed"


def test_bench_ttft_draws_its_plot(ttft_bench):
    pytest.importorskip("matplotlib")
    _, _, plot = ttft_bench
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_ttft_restores_encrypted_pages_and_reports_their_cost(tmp_path):
    args = ["--json", "--store", str(tmp_path), "--page-size", str(TTFT_PAGE), "--lengths", "150", "--encrypt-l3"]
    report = json.loads(kvtier("bench", "ttft", *args).stdout)
    assert report["sources"] == ["recompute", "L1", "L2", "L3", "L3 aes"]
    (row,) = report["rows"]
    assert row["sources"]["L3 aes"] == restored_from("L3", 150)  # labelled L3: an L3 restore, of encrypted records
    (cost,) = report["encryption"]
    assert cost["prompt_tokens"] == 150
    assert cost["ratio"] == pytest.approx(row["ttft_s"]["L3 aes"] / row["ttft_s"]["L3"], abs=5e-4)
    assert list(tmp_path.iterdir()) == [], "the scratch stores must be removed"


@needs_redis
def test_bench_ttft_restores_from_redis_after_a_restart_and_leaves_nothing_there(redis_server, tmp_path):
    done = kvtier(
        "bench",
        "ttft",
        "--json",
        "--store",
        str(tmp_path),
        "--page-size",
        "64",
        "--lengths",
        "150",
        "--redis",
        redis_server.url,
    )
    (row,) = json.loads(done.stdout)["rows"]
    assert row["sources"]["Redis"] == {"L1": 0, "L2": 0, "L3": 128, "recomputed": 22}
    assert row["ttft_s"]["Redis"] > 0 and "Redis" in row["ratio_to_recompute"]
    assert redis_server.client().dbsize() == 0, "the scratch prefix must be emptied"
