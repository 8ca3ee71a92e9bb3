"""The step loop never waits on L3: an L3 read that stalls (a store whose snapshots
block on an Event, through ``L3Store.snapshot``) is abandoned at its deadline for
recompute and counted, while other requests, ``/metrics``, ``/v1/kvtier/stats`` and
``/health`` (degraded, naming L3) answer (the small generated model, in process); the
abandoned reads are persisted with the store's counters (``kvtier stats``)."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

from starlette.testclient import TestClient

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.tiers.hierarchy import StoreConfig

from .. import cli
from .conftest import mlx_lm_greedy, text_prompt

PAGE = 16


def test_a_stalled_l3_read_is_abandoned_and_everything_else_answers(loaded, tmp_path, monkeypatch):
    stored, other = text_prompt(loaded, 5 * PAGE + 3, seed=1), text_prompt(loaded, 3 * PAGE + 1, seed=2)
    params = SamplingParams(max_tokens=4)
    first = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=tmp_path)))
    first.generate([stored], params)
    first.close()  # its pages are in L3 only
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=tmp_path)))
    disk, unfreeze = engine.store.disk, threading.Event()
    opened = disk.snapshot

    @contextmanager
    def frozen():  # a hung disk: the read waits until the test lets it go
        unfreeze.wait(60)
        with opened() as snapshot:
            yield snapshot

    monkeypatch.setattr(disk, "snapshot", frozen)
    server = KVTierServer(engine, ServerConfig("m"))
    server.start()
    try:
        with TestClient(server.app, raise_server_exceptions=False) as http:
            stalled = engine.submit(stored, params)
            answered = engine.submit(other, params)
            assert list(answered.stream()) == mlx_lm_greedy(loaded, other, 4)
            assert list(stalled.stream()) == mlx_lm_greedy(loaded, stored, 4)
            again = engine.submit(other, params)  # in L1 now: L3 is not asked at all
            assert list(again.stream()) == mlx_lm_greedy(loaded, other, 4) and again.sources()["L1"] == 3 * PAGE
            assert not unfreeze.is_set()  # all done while the reads are still stuck
            assert stalled.sources()["recomputed"] == len(stored) and stalled.finish_reason == "length"
            assert http.get("/health").json() == {"status": "degraded", "model": "m", "degraded": ["L3"]}
            assert http.get("/v1/kvtier/stats").json()["reads_abandoned"] == 2  # both prompts' reads
            assert "kvtier_l3_reads_abandoned_total 2.0" in http.get("/metrics").text
            assert not engine.store.view().pins  # the abandoned restores hold nothing
            unfreeze.set()
            deadline = time.monotonic() + 10
            while http.get("/health").json()["status"] != "ok" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert http.get("/health").json() == {"status": "ok", "model": "m"}
    finally:
        unfreeze.set()
        server.close()
    stopped = cli.run(["stats", "--json", "--store", tmp_path])  # the store of a stopped server
    assert json.loads(stopped.stdout)["reads_abandoned"] == 2
    table = cli.run(["stats", "--store", tmp_path]).stdout
    assert "L3 reads abandoned at their deadline (those requests recomputed instead): 2" in table
