"""Damage in a store's side tables never takes anything down (issue 25, item 6): garbage
in any meta value, the counters, a profile, the namespaces table (LMDB) or the meta,
counters and namespaces hashes (Redis) is one warning line and a defined fallback in
every command that opens the store, and in ``kvtier serve`` as it starts.

Commands run in this process (``tests/cli.py``) except ``serve``, which is about the
process (it must come up, and stop on SIGTERM)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import msgpack
import pytest

from kvtier.tiers.l3 import lmdb_space

from .. import cli
from ..redis_servers import needs_redis, redis_server  # noqa: F401
from .conftest import on_tiny_model

PROMPT = "the system prompt of an agent with tools " * 2  # ~80 tokens: 5 pages of 16
GARBAGE = b"\xc1" * 9  # nine bytes no msgpack decoder reads (0xc1 is never used)
WRONG_SHAPE = msgpack.packb({"pages": "many"})  # well-formed, but no value of any table looks so
COMMANDS = (
    ("run", "--prompt", PROMPT, "--page-size", "16", "--max-tokens", "2", "--json"),
    ("stats", "--json"),
    ("store", "ls", "--json"),
    ("store", "resize", "--l3-bytes", "1GiB"),
    ("store", "clear"),
    ("store", "compact"),
)


def kvtier(store: Path | str, *args: str) -> subprocess.CompletedProcess:
    at = 2 if args[0] == "store" else 1
    return cli.run(on_tiny_model([*args[:at], "--store", str(store), *args[at:]]))


def warnings(done: subprocess.CompletedProcess) -> list[str]:
    """The command's stderr, which must be nothing but warnings (no traceback, no error)."""
    lines = done.stderr.strip().splitlines()
    assert all(line.startswith("kvtier: WARNING: ") for line in lines), done.stderr
    return lines


def side_values(store: Path) -> list[tuple[bytes, bytes]]:
    """(database, key) of every side value the store holds: meta numbers and entries,
    the counters, the namespace rows."""
    env = lmdb.open(str(store), max_dbs=8, readonly=True)
    try:
        with env.begin() as txn:
            found = [
                (name, bytes(key))
                for name in (b"meta", b"counters", b"namespaces")
                for key, _ in txn.cursor(db=env.open_db(name, txn=txn, create=False))
            ]
    finally:
        env.close()
    return [(db, key) for db, key in found if key != b"format_version"]


def damage(store: Path, db: bytes, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(store), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            txn.put(key, value, db=env.open_db(db, txn=txn))
    finally:
        env.close()


def gauges(store: Path) -> tuple:
    """What the fallbacks must give back: the L3 gauges and each namespace's counts."""
    stats = json.loads(kvtier(store, "stats", "--json").stdout)["tiers"]["L3"]
    listing = json.loads(kvtier(store, "store", "ls", "--json").stdout)
    rows = sorted((r["namespace"], r["pages"], r["bytes"], r["tokens"]) for r in listing["namespaces"])
    return stats["pages"], stats["bytes_used"], stats["capacity"], rows


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A store holding one run's pages, counters, profile and namespace row; that run's output."""
    store = tmp_path_factory.mktemp("written") / "store"
    done = kvtier(store, *COMMANDS[0])
    assert done.returncode == 0 and not done.stderr, done.stderr
    return store, [json.loads(line)["output_token_ids"] for line in done.stdout.splitlines()[:-1]]


def test_the_store_has_every_kind_of_side_value(written):
    names = {key.split(b"/")[0] if db == b"meta" else db for db, key in side_values(written[0])}
    assert names >= {b"bytes_used", b"pages", b"access_seq", b"clock", b"capacity", b"user", b"counters", b"namespaces"}


@pytest.fixture
def steady_disk(monkeypatch) -> None:
    """A filesystem whose free space does not move: a damaged cap falls back to the
    default, which is half the free space on a small disk, and other tests write to
    this one while the commands run (each command's warning names the cap it took)."""
    monkeypatch.setattr(lmdb_space, "usage", lambda path: lmdb_space.Usage(1 << 40, 0, 1 << 40))


@pytest.mark.usefixtures("steady_disk")
@pytest.mark.parametrize("garbage", [GARBAGE, WRONG_SHAPE], ids=["garbage", "wrong-shape"])
def test_each_damaged_side_value_is_one_warning_and_a_fallback_in_every_command(written, tmp_path, garbage):
    store, outputs = written
    sound = gauges(store)
    for db, key in side_values(store):
        if garbage == WRONG_SHAPE and key == b"user/last_run":
            continue  # free-form (what the last run said): any well-formed value is one
        warned = []
        for command in COMMANDS:
            copy = tmp_path / "copy"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(store, copy)
            damage(copy, db, key, garbage)
            done = kvtier(copy, *command)
            assert done.returncode == 0, (db, key, command, done.stderr)
            lines = warnings(done)
            assert len(lines) <= 1 and "damaged" in done.stderr if lines else True, (db, key, command, lines)
            warned += lines
            if command[0] == "run":
                ran = [json.loads(line)["output_token_ids"] for line in done.stdout.splitlines()[:-1]]
                assert ran == outputs, (db, key)
                after = kvtier(copy, "stats", "--json"), kvtier(copy, "store", "ls", "--json")
                assert [a.stderr for a in after] == ["", ""], (db, key)  # the run repaired the store
            if command[0] == "stats" and key != b"capacity":
                assert gauges(copy) == sound, (db, key)  # recounted, rebuilt (or never used)
        assert warned, f"no command noticed the damage to {db!r} {key!r}"
        assert len({line for line in warned}) == 1, warned


@pytest.mark.slow  # starts kvtier serve
def test_serve_starts_and_stops_with_every_side_value_damaged(written, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(written[0], store)
    for db, key in side_values(store):
        damage(store, db, key, GARBAGE)
    args = on_tiny_model(["serve", "--port", "0", "--store", str(store), "--page-size", "16"])
    child = subprocess.Popen([sys.executable, "-m", "kvtier.engine.cli", *args], stderr=subprocess.PIPE, text=True)
    log = []
    for line in child.stderr:
        log.append(line)
        if " on http://" in line:
            break
    child.send_signal(signal.SIGTERM)
    log += child.stderr.read().splitlines(keepends=True)
    assert child.wait(timeout=60) == 0, "".join(log)
    damaged = [line for line in log if "damaged" in line]
    assert damaged and len(damaged) == len(set(damaged)), "".join(log)
    assert not [line for line in log if "Traceback" in line or "error:" in line], "".join(log)


@needs_redis
@pytest.mark.slow  # starts redis-server
def test_garbage_in_the_redis_side_hashes_is_one_warning_and_a_fallback(redis_server):
    url = redis_server.url
    assert kvtier(url, *COMMANDS[0]).returncode == 0
    client = redis_server.client()
    fields = [
        (b"kvtier:meta", b"format_version"),
        (b"kvtier:meta", b"user/last_run"),
        (b"kvtier:counters", b"engine/requests"),
        (b"kvtier:ns", client.hkeys(b"kvtier:ns")[0]),
    ]
    for name, field in fields:
        assert client.hexists(name, field), (name, field)
        client.hset(name, field, GARBAGE)
        stats, run = kvtier(url, "stats", "--json"), kvtier(url, *COMMANDS[0])
        assert (stats.returncode, run.returncode) == (0, 0), (field, stats.stderr, run.stderr)
        noticed = [line for done in (stats, run) for line in warnings(done)]
        assert all("damaged" in line for line in noticed), (field, noticed)
        if name == b"kvtier:ns":  # read by nothing here: the run describes its namespace anew
            assert msgpack.unpackb(client.hget(name, field))["about"], field
        else:
            assert noticed, field
        assert len(warnings(run)) <= 1 and len(warnings(stats)) <= 1, (field, noticed)
        assert json.loads(stats.stdout)["tiers"]["L3"]["pages"] > 0
