"""The step loop never waits on L3: a stalled L3 read (an L3 throttled to a crawl, the
public seam ``StoreConfig.throttle``) is abandoned at its deadline for recompute and
counted, while other requests, ``/metrics``, ``/v1/kvtier/stats`` and ``/health``
(degraded, naming L3) answer (the small generated model, in process)."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.tiers.hierarchy import StoreConfig

from .conftest import mlx_lm_greedy, text_prompt

PAGE = 16
STALL_S = 6.0  # one stalled read of the stored pages takes this long


def test_a_stalled_l3_read_is_abandoned_and_everything_else_answers(loaded, tmp_path):
    stored, other = text_prompt(loaded, 5 * PAGE + 3, seed=1), text_prompt(loaded, 3 * PAGE + 1, seed=2)
    params = SamplingParams(max_tokens=4)
    first = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=tmp_path)))
    first.generate([stored], params)
    first.close()  # its pages are in L3 only
    page_bytes = first.geometry.nbytes
    store = StoreConfig(store_dir=tmp_path, throttle={"L3": 5 * page_bytes / STALL_S})
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store))
    server = KVTierServer(engine, ServerConfig("m"))
    server.start()
    try:
        with TestClient(server.app, raise_server_exceptions=False) as http:
            t0 = time.monotonic()
            stalled = engine.submit(stored, params)
            answered = engine.submit(other, params)
            assert list(answered.stream()) == mlx_lm_greedy(loaded, other, 4)
            assert list(stalled.stream()) == mlx_lm_greedy(loaded, stored, 4)
            assert time.monotonic() - t0 < STALL_S  # done while the read is still stalled
            assert stalled.sources()["recomputed"] == len(stored) and stalled.finish_reason == "length"
            assert http.get("/health").json() == {"status": "degraded", "model": "m", "degraded": ["L3"]}
            assert http.get("/v1/kvtier/stats").json()["reads_abandoned"] == 1
            assert "kvtier_l3_reads_abandoned_total 1.0" in http.get("/metrics").text
            assert not engine.store.view().pins  # the abandoned restore holds nothing
    finally:
        server.close()
