"""The step loop never waits on L3: an L3 read that stalls (a store whose snapshots
block on an Event, through ``L3Store.snapshot``; for a hybrid model every read of L3)
is abandoned at its deadline for recompute and counted, while other requests,
``/metrics``, ``/v1/kvtier/stats`` and ``/health`` (degraded, naming L3) answer (the
small generated models, in process); the abandoned reads are persisted with the
store's counters (``kvtier stats``)."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import pytest
from starlette.testclient import TestClient

from kvtier.costmodel.models import ComputeModel
from kvtier.costmodel.plan import Profile
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.engine.request import SamplingParams
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.tiers.hierarchy import StoreConfig

from .. import cli
from .conftest import mlx_lm_greedy, text_prompt
from .kind_models import write_model

PAGE = 16


def test_a_stalled_l3_read_is_abandoned_and_everything_else_answers(loaded, tmp_path, monkeypatch):
    stored, other = text_prompt(loaded, 5 * PAGE + 3, seed=1), text_prompt(loaded, 3 * PAGE + 1, seed=2)
    params = SamplingParams(max_tokens=4)
    first = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=tmp_path)))
    first.generate([stored], params)
    first.close()  # its pages are in L3 only
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=tmp_path)))
    unfreeze = threading.Event()
    freeze(engine.store.disk, unfreeze, monkeypatch)  # a hung disk: reads wait until the test lets them go
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
            assert not engine.store.accounts.view().pins  # the abandoned restores hold nothing
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


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return load_model(str(write_model(tmp_path_factory.mktemp("models") / "lfm2", "lfm2")))


def freeze(disk, unfreeze: threading.Event, monkeypatch) -> None:
    """Every read of ``disk`` (a snapshot, an existence check, a get) waits for
    ``unfreeze``, as on a hung disk (at most 30 s: a step loop that waits shows as a
    request not answered in time, not as a hung test)."""
    opened, contains, present, get = disk.snapshot, disk.contains, disk.present, disk.get

    @contextmanager
    def snapshot():
        unfreeze.wait(30)
        with opened() as snap:
            yield snap

    def frozen(read):
        return lambda *args, **kwargs: (unfreeze.wait(30), read(*args, **kwargs))[1]

    monkeypatch.setattr(disk, "snapshot", snapshot)
    for name, read in (("contains", contains), ("present", present), ("get", get)):
        monkeypatch.setattr(disk, name, frozen(read))


def finished(request, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not request.done and time.monotonic() < deadline:
        time.sleep(0.02)
    return request.done


def test_a_hybrids_snapshot_reads_are_off_the_step_loop_too(lfm2, tmp_path, monkeypatch):
    """Its pages in L1 and the snapshots after them in L3 only (the snapshot tiers keep
    none): the restore points and the snapshot are read off the loop, before admission;
    with L3 frozen the read is abandoned at its deadline (recompute), everything else
    answers; once L3 answers, a prompt of the same pages restores them with L3's snapshot."""
    prompt, other = text_prompt(lfm2, 9 * PAGE + 6, seed=3), text_prompt(lfm2, 2 * PAGE + 5, seed=4)
    tail = [t for t in text_prompt(lfm2, 12, seed=5) if t != prompt[9 * PAGE]][:6]
    params = SamplingParams(max_tokens=4)
    store = StoreConfig(l1_bytes=1 << 26, store_dir=tmp_path, snapshot_l1_bytes=1, snapshot_l2_bytes=1)
    engine = Engine(lfm2, EngineConfig(page_size=PAGE, store=store, snapshot_spacing=2))
    engine.profile = Profile(Profile.defaults().links, ComputeModel([0.0, 0.01, 0.0]))  # restoring wins; 1.5 s
    engine.profile.compute.observe = lambda *args, **kwargs: None  # not learned online
    engine.generate([prompt], params)
    engine.store.settle()
    assert (
        engine.store.accounts.view().l1.pages == 10 and engine.store.accounts.view().snapshots[0].pages == 0
    )  # 9 + the partial
    unfreeze = threading.Event()
    freeze(engine.store.disk, unfreeze, monkeypatch)
    server = KVTierServer(engine, ServerConfig("m"))
    server.start()
    try:
        with TestClient(server.app, raise_server_exceptions=False) as http:
            stalled, answered = engine.submit(prompt, params), engine.submit(other, params)
            assert finished(answered, 10) and finished(stalled, 10), "the step loop waited on L3"
            assert list(answered.stream()) == mlx_lm_greedy(lfm2, other, 4)
            assert list(stalled.stream()) == mlx_lm_greedy(lfm2, prompt, 4)
            assert stalled.sources()["recomputed"] == len(prompt) and not unfreeze.is_set()
            assert http.get("/health").json() == {"status": "degraded", "model": "m", "degraded": ["L3"]}
            assert http.get("/v1/kvtier/stats").json()["reads_abandoned"] == 2
            assert "kvtier_l3_reads_abandoned_total 2.0" in http.get("/metrics").text
            assert not engine.store.accounts.view().pins
            unfreeze.set()
            deadline = time.monotonic() + 10
            while http.get("/health").json()["status"] != "ok" and time.monotonic() < deadline:
                time.sleep(0.05)
            # the same 9 pages, another tail: the stalled request kept its own tail in L1
            # with the state after it (a partial page), so its tail must differ
            branch = prompt[: 9 * PAGE] + tail
            again = engine.submit(branch, params)
            assert list(again.stream()) == mlx_lm_greedy(lfm2, branch, 4)
            # pages 1-8 from L1, page 9 with its state from L3 (a token is labelled by its slowest part)
            assert again.sources() == {"L1": 8 * PAGE, "L2": 0, "L3": PAGE, "recomputed": 6}
    finally:
        unfreeze.set()
        server.close()
