"""The CLI as a newcomer meets it (issue 12): limits, one-line errors with the store
intact, store management, Ctrl-C, streaming, help. Commands run in this process
(``tests/cli.py``) except where a test is about the process (signals, stdin's fd)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.costmodel.calibrate import QUICK_PAGE_COUNTS
from kvtier.costmodel.plan import Profile
from kvtier.tiers.l3.lmdb_store import DiskTier

from .. import cli
from ..tiers.lmdb_files import opened_elsewhere
from .conftest import on_tiny_model
from .kind_models import write_model

pytestmark = pytest.mark.slow  # starts processes or loads the real model

PROMPT = "the system prompt of an agent with tools " * 3  # ~120 tokens: 7 pages of 16


def kvtier(
    *args: str, check: bool = True, stdin: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    done = cli.run(on_tiny_model(args), stdin=stdin, env=env)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def run_json(store: Path, *args: str) -> list[dict]:
    out = kvtier("run", "--json", "--store", str(store), "--page-size", "16", "--max-tokens", "1", *args).stdout
    return [json.loads(line) for line in out.splitlines()]


def store_state(store: Path) -> tuple:
    """Everything a bad input must leave alone: pages, bytes, namespaces, the file."""
    with DiskTier(store, readonly=True) as disk:
        return (
            disk.counters.pages,
            disk.counters.bytes_used,
            disk.counters.capacity,
            disk.tables.namespaces(),
            (store / "data.mdb").read_bytes(),
        )


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A store holding the pages of one run."""
    path = tmp_path_factory.mktemp("store")
    run_json(path, "--prompt", PROMPT)
    return path


def long_prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "long.txt"
    path.write_text("x" * 40_000)  # byte tokenizer: 40,000 tokens > the 32,768-token context
    return path


BAD = [  # (argv, message); {store} is the module's store, {file} a regular file, {long} a 40 KB prompt
    (["run", "--prompt", ""], "empty prompt"),
    (["run"], "one of the arguments --prompt --prompt-file --prompts-file is required"),
    (["run", "--prompt", "hi", "--l1-bytes", "12XB"], "bad size"),
    (["run", "--prompt", "hi", "--l1-bytes", "99999TiB"], "more than this machine's memory"),
    (["run", "--prompt", "hi", "--l2-bytes", "99999TiB"], "more than this machine's memory"),
    (["run", "--prompt", "hi", "--model", "/no/such/model"], "not an mlx-lm model"),
    (["run", "--prompt", "hi", "--max-tokens", "0"], "positive whole number"),
    (["run", "--prompt", "hi", "--max-tokens", "-3"], "positive whole number"),
    (["run", "--prompt", "hi", "--max-tokens", str(10**12)], "exceeds the model's context of 32768 tokens"),
    (["run", "--prompt-file", "{long}"], "exceeds the model's context of 32768 tokens"),
    (["run", "--prompt", "hi", "--temperature", "-1"], "must be >= 0"),
    (["run", "--prompt", "hi", "--temperature", "nan"], "expected a number"),
    (["run", "--prompt", "hi", "--top-p", "0"], "must be in (0, 1]"),
    (["run", "--prompt", "hi", "--top-p", "1.5"], "must be in (0, 1]"),
    (["run", "--prompt", "hi", "--refresh-window", "-1"], "whole number >= 0"),
    (["run", "--prompt", "hi", "--page-size", "0"], "positive whole number"),
    (["run", "--prompt", "hi", "--codec", "lz4"], "invalid choice"),
    (["run", "--prompt", "hi", "--throttle", "L9=1MiB/s"], "bad throttle"),
    (["run", "--prompt", "hi", "--throttle", "L3=0/s"], "must be positive"),
    (["run", "--prompt-file", "/no/such/prompt.txt"], "cannot read"),
    (["run", "--prompts-file", "/no/such/prompts.jsonl"], "cannot read"),
    (["run", "--prompt", "hi", "--store", "{file}"], "is not a directory"),
    (["run", "--prompt", "hi", "--store", "{file}/sub"], "cannot create store directory"),
    (["calibrate", "--store", "{file}"], "is not a directory"),
    (["bench", "restore", "--store", "{file}"], "is not a directory"),
    (["bench", "restore", "--plot", "/no/such/dir/bw.png"], "does not exist or is not writable"),
    (["bench", "restore", "--plot", "{store}"], "is a directory"),
    (["bench", "ttft", "--lengths", "512,many"], "positive whole numbers separated by commas"),
    (["bench", "ttft", "--lengths", "100,512"], "--lengths must be from 129"),
    (["bench", "ttft", "--lengths", "512,32768"], "to 32767 (the model's context less the first token)"),
    (["bench", "ttft", "--plot", "/no/such/dir/ttft.png"], "does not exist or is not writable"),
    (["bench", "ttft", "--store", "redis://127.0.0.1:1"], "give a directory here"),
    (["bench", "ttft", "--redis", "127.0.0.1:6379"], "expected a redis://"),
    (["bench", "ttft", "--redis", "redis://127.0.0.1:1/0"], "cannot use Redis store"),
    (["stats", "--store", "/no/such/store"], "no kvtier store"),
    (["stats", "--store", "{file}"], "no kvtier store"),
    (["store", "ls", "--store", "/no/such/store"], "no kvtier store"),
    (["store", "clear", "--namespace", "ffffffff"], "matches 0 namespaces"),
    (["store", "resize"], "the following arguments are required: --l3-bytes"),
    (["store", "resize", "--l3-bytes", "lots"], "bad size"),
    (["store", "compact", "--store", "/no/such/store"], "no kvtier store"),
    (["store"], "required"),
    (["frobnicate"], "invalid choice"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_the_store_is_intact(store, tmp_path, argv, message):
    (tmp_path / "file").write_text("not a directory")
    names = {"{store}": str(store), "{file}": str(tmp_path / "file"), "{long}": str(long_prompt_file(tmp_path))}
    argv = [names.get(a, a.replace("{file}", names["{file}"])) for a in argv]
    if argv[0] in ("run", "store") and "--store" not in argv and len(argv) > 1:
        argv += ["--store", str(store)]
    if argv[0] == "run" and "--page-size" not in argv:
        argv += ["--page-size", "16"]  # the store's: no warning about another page size
    before = store_state(store)
    done = kvtier(*argv, check=False)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert store_state(store) == before


@pytest.mark.parametrize(
    "architecture, message",
    [
        ("llama4", "kvtier cannot serve ChunkedKVCache layers: mlx-lm's BatchGenerator"),  # chunked attention
        ("mamba", "kvtier cannot serve a model of ArraysCache layers only"),  # recurrent layers, no attention
    ],
)
def test_unsupported_model_is_one_line_and_exit_2(tmp_path, architecture, message):
    """A model kvtier cannot serve: refused before any work, the kind named."""
    model_dir = write_model(tmp_path / architecture, architecture)
    for argv in (["run", "--prompt", "hi"], ["calibrate"], ["bench", "restore"]):
        done = kvtier(*argv, "--model", str(model_dir), "--store", str(tmp_path / "s"), check=False)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_long_prompt_from_a_file_or_stdin(tmp_path):
    text = "a long prompt " * 30  # 420 tokens (argv limits bite far later; the path is what counts)
    (tmp_path / "p.txt").write_text(text)
    (from_file, _) = run_json(tmp_path / "s", "--no-offload", "--prompt-file", str(tmp_path / "p.txt"))
    (from_stdin, _) = [
        json.loads(line)
        for line in kvtier(
            "run", "--json", "--no-offload", "--max-tokens", "1", "--prompt", "-", stdin=text
        ).stdout.splitlines()
    ]
    assert from_file["prompt_tokens"] == from_stdin["prompt_tokens"] == len(text.encode())
    assert from_file["output_token_ids"] == from_stdin["output_token_ids"]


def test_stats_reads_a_store_without_writing_it(store):
    before = (store / "data.mdb").stat()
    stats = json.loads(kvtier("stats", "--json", "--store", str(store)).stdout)
    after = (store / "data.mdb").stat()
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    l3 = stats["tiers"]["L3"]
    cap = store_state(store)[2]  # the default: 32 GiB, or half the free disk where that is less
    assert 0 < l3["capacity"] == cap <= 32 << 30 and l3["pages"] == 7 and l3["file_bytes"] == before.st_size
    text = kvtier("stats", "--store", str(store)).stdout
    header = text.splitlines()[0].split()
    assert "checksum_failures" in header and "writes_dropped" in header  # not cut to 12 characters
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:4]}
    assert rows["L1"][1] == rows["L2"][1] == "-" and rows["L3"][1] == str(cap)


def without_dac_override() -> None:
    """A child's ``preexec_fn``: as root, drop the capabilities that ignore file modes
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) from its bounding set, so a read-only
    directory is read-only to it as it is to any user (CI runs as root)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_stats_works_on_a_read_only_store(store, tmp_path):
    copy = tmp_path / "ro"
    shutil.copytree(store, copy)
    for path in (copy / "data.mdb", copy / "lock.mdb", copy):
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvtier.engine.cli", "stats", "--json", "--store", str(copy)],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=without_dac_override,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["tiers"]["L3"]["pages"] == 7
        probe = subprocess.run(["touch", str(copy / "x")], preexec_fn=without_dac_override, capture_output=True)
        assert probe.returncode != 0, "the store must be read-only to the child"
    finally:
        copy.chmod(0o755)


def test_a_read_only_store_is_restored_from_and_its_writes_counted_as_dropped(store, tmp_path):
    """Run as a user who cannot write the store (chmod; as root, a child without the
    capabilities that ignore file modes): one warning, pages restored, writes counted."""
    copy = tmp_path / "ro"
    shutil.copytree(store, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    longer = PROMPT + "and one more question about the weather"  # its new pages cannot be kept
    for path in [*copy.iterdir(), copy]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        args = ["run", "--json", "--store", str(copy), "--page-size", "16", "--max-tokens", "1", "--prompt", longer]
        done = subprocess.run(
            [sys.executable, "-m", "kvtier.engine.cli", *on_tiny_model(args)],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=without_dac_override,
        )
    finally:
        for path in [copy, *copy.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (
        f"kvtier: WARNING: store {copy} is read-only to this process: restoring pages from it, "
        "every write dropped (counted)"
    )
    result, counters = (json.loads(line) for line in done.stdout.splitlines())
    assert result["sources"]["L3"] == 7 * 16  # the stored prefix, restored
    assert counters["counters"]["tiers"]["L3"]["writes_dropped"] > 0
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before  # not a byte written


def test_the_cap_belongs_to_the_store(tmp_path):
    run_json(tmp_path, "--l3-bytes", "64MiB", "--prompt", PROMPT)
    done = kvtier(
        "run",
        "--json",
        "--store",
        str(tmp_path),
        "--page-size",
        "16",
        "--max-tokens",
        "1",
        "--l3-bytes",
        "1MiB",
        "--prompt",
        "another prompt entirely " * 6,
    )
    assert "keeps its L3 cap of 64.0 MiB; the 1.0 MiB asked for is ignored" in done.stderr
    stats = json.loads(kvtier("stats", "--json", "--store", str(tmp_path)).stdout)["tiers"]["L3"]
    assert (
        stats["capacity"] == 64 << 20 and stats["evictions"] == 0 and stats["pages"] == 7 + 9
    )  # every full page of both


def test_another_page_size_says_so(store):
    done = kvtier("run", "--json", "--store", str(store), "--page-size", "32", "--max-tokens", "1", "--prompt", PROMPT)
    lines = [line for line in done.stderr.splitlines() if "holds no pages for this model and page size" in line]
    assert len(lines) == 1 and "page size 16" in lines[0] and "page size 32" in lines[0]


def test_store_ls_clear_resize_compact(tmp_path):
    run_json(tmp_path, "--prompt", PROMPT)
    run_json(tmp_path, "--prompt", PROMPT, "--cache-salt", "tenant-b")
    listing = json.loads(kvtier("store", "ls", "--json", "--store", str(tmp_path)).stdout)
    assert listing["pages"] == 14 and len(listing["namespaces"]) == 2
    for ns in listing["namespaces"]:
        assert (ns["pages"], ns["tokens"], ns["page_size"], ns["model"]) == (7, 112, 16, "kvtier-tiny")
        assert ns["bytes"] > 7 * 16 * 24576 and ns["last_use"] > 0
    assert "kvtier-tiny" in kvtier("store", "ls", "--store", str(tmp_path)).stdout

    salted = next(ns for ns in listing["namespaces"] if ns["salted"])["namespace"]
    done = kvtier("store", "clear", "--namespace", salted[:8], "--store", str(tmp_path))
    assert "removed 7 pages" in done.stdout
    (result, _) = run_json(tmp_path, "--prompt", PROMPT)
    assert result["sources"]["L3"] == 112  # the other namespace is untouched

    before = (tmp_path / "data.mdb").stat().st_size
    kvtier("store", "compact", "--store", str(tmp_path))
    after = (tmp_path / "data.mdb").stat().st_size
    assert after < before - 6 * 16 * 24576  # the cleared namespace's 7 pages no longer take room
    (result, _) = run_json(tmp_path, "--prompt", PROMPT)
    assert result["sources"]["L3"] == 112  # the compacted store still serves its pages

    page = listing["namespaces"][0]["bytes"] // 7
    evictions = json.loads(kvtier("stats", "--json", "--store", str(tmp_path)).stdout)["tiers"]["L3"]["evictions"]
    done = kvtier("store", "resize", "--l3-bytes", str(3 * page), "--store", str(tmp_path))
    assert "4 pages evicted" in done.stdout
    stats = json.loads(kvtier("stats", "--json", "--store", str(tmp_path)).stdout)["tiers"]["L3"]
    assert stats["capacity"] == 3 * page and stats["pages"] == 3
    assert stats["evictions"] == evictions + 4  # counted in the store, as every other eviction

    assert "removed 3 pages" in kvtier("store", "clear", "--store", str(tmp_path)).stdout
    assert json.loads(kvtier("store", "ls", "--json", "--store", str(tmp_path)).stdout)["pages"] == 0


def test_compact_refuses_a_store_in_use(store):
    with opened_elsewhere(store):
        done = kvtier("store", "compact", "--store", str(store), check=False)
    assert done.returncode == 2 and "open in another process" in done.stderr


def test_stats_reset(tmp_path):
    run_json(tmp_path, "--prompt", PROMPT)
    assert json.loads(kvtier("stats", "--json", "--store", str(tmp_path)).stdout)["engine"]["requests"] == 1
    kvtier("stats", "--reset", "--store", str(tmp_path))
    stats = json.loads(kvtier("stats", "--json", "--store", str(tmp_path)).stdout)
    assert "engine" not in stats and "last_run" not in stats and stats["tiers"]["L3"]["pages"] == 7


def test_ctrl_c_streams_then_keeps_pages_and_exits_130(tmp_path):
    """Tokens appear while the request runs; Ctrl-C ends it with one line, exit 130, and
    the prompt's pages safely in the store."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.engine.cli",
            *on_tiny_model(
                ["run", "--store", str(tmp_path), "--page-size", "16", "--max-tokens", "20000", "--prompt", PROMPT]
            ),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().startswith("── request 0")
        assert proc.stdout.read(1)  # generated text, long before the 20,000 tokens end
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip() == f"kvtier: interrupted; 7 pages kept in {tmp_path}"
    (result, _) = run_json(tmp_path, "--prompt", PROMPT)
    assert result["sources"]["L3"] == 112


def test_help_version_and_verbose_after_the_subcommand():
    text = kvtier("run", "--help").stdout
    for needle in (
        "(default: 32)",
        "(default: 1GiB)",
        "(default: 4GiB)",
        "32.0 GiB",
        "(default: 128)",
        "512MiB",
        "KVTIER_HOME",
        "KVTIER_NO_OPENBLAS",
        "store",
    ):
        assert needle in text
    assert kvtier("--version").stdout.strip().startswith("kvtier 0.")
    done = kvtier("run", "-v", "--no-offload", "--max-tokens", "1", "--prompt", "hi")
    assert "kvtier: INFO: BLAS:" in done.stderr


def test_first_use_of_a_store_calibrates_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_NO_AUTO_CALIBRATE"}
    first = kvtier("run", "--json", "--store", str(tmp_path), "--max-tokens", "1", "--prompt", "hi", env=env)
    assert "a quick calibration first" in first.stderr
    fitted = json.loads(first.stdout.splitlines()[-1])["counters"]["costmodel"]
    defaults = Profile.defaults().summary().to_json()
    assert fitted["calibrated"]
    for link in ("L2->L1", "L3->L1", "L3->L2"):  # every link measured, once per size of the quick grid (its
        # fit may still be the old one: samples that contradict it without growing with their bytes, on a
        # busy machine, leave it: LinkModel.repaired)
        assert fitted["links"][link]["samples"] == len(QUICK_PAGE_COUNTS), link
        assert defaults["links"][link]["samples"] == 0
    assert [fitted["compute"][c] for c in ("c0", "c1", "c2")] != [defaults["compute"][c] for c in ("c0", "c1", "c2")]
    second = kvtier("run", "--json", "--store", str(tmp_path), "--max-tokens", "1", "--prompt", "hi", env=env)
    assert "calibration" not in second.stderr
    skipped = kvtier(
        "run",
        "--json",
        "--store",
        str(tmp_path / "other"),
        "--max-tokens",
        "1",
        "--no-auto-calibrate",
        "--prompt",
        "hi",
        env=env,
    )
    assert "calibration" not in skipped.stderr
    assert not json.loads(skipped.stdout.splitlines()[-1])["counters"]["costmodel"]["calibrated"]


def test_l3_cap_0_drops_writes_and_no_bytes_cross_to_l3(tmp_path):
    counters = run_json(tmp_path, "--l3-bytes", "0", "--prompt", PROMPT)[-1]["counters"]
    assert counters["tiers"]["L3"]["writes_dropped"] == 7 and counters["tiers"]["L3"]["inserts"] == 0
    assert counters["links"]["L1->L3"]["bytes"] == counters["links"]["L2->L3"]["bytes"] == 0


def _commands(parser, prefix=()) -> list[tuple[str, ...]]:
    """Every command path of the parser: (), ("run",), ("store", "ls"), ..."""
    import argparse

    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*prefix, name))
    return found


def test_every_flag_in_help_is_in_the_readme_flag_list():
    import re

    from kvtier.engine.cli import build_parser

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("## Flags")
    flags = readme[start : readme.index("\n## ", start)]  # up to the next section
    for command in _commands(build_parser()):
        text = kvtier(*command, "--help").stdout
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", text)) - {"--help"}:
            assert flag in flags, f"kvtier {' '.join(command)}: {flag} is not in the README's flag list"


def test_ctrl_c_in_bench_removes_its_scratch_store_and_exits_130(tmp_path):
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.engine.cli",
            *on_tiny_model(["bench", "restore", "--store", str(tmp_path), "--page-size", "16"]),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("calibration-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(tmp_path.glob("calibration-*")), "the bench never started measuring"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == f"kvtier: interrupted; 0 pages kept in {tmp_path}"
    assert "Traceback" not in err and not list(tmp_path.glob("calibration-*"))


def test_an_l3_cap_beyond_the_free_disk_space_is_a_warning(tmp_path):
    done = kvtier(
        "run", "--json", "--store", str(tmp_path), "--max-tokens", "1", "--l3-bytes", "99999TiB", "--prompt", "hi"
    )
    assert "is more than the free space" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert json.loads(done.stdout.splitlines()[-1])["counters"]["tiers"]["L3"]["capacity"] == 99999 << 40
