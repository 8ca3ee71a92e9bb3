"""A dashboard server for the tests that need a real one (a browser, ``kvtier top``): the
server app under uvicorn in a thread, on a free 127.0.0.1 port, after a scripted
workload on the generated tiny model whose prompts reach every source."""

from __future__ import annotations

import random
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.tiers.hierarchy import StoreConfig

PAGE_TOKENS = 16


def _prompt(seed: int, n: int = 96) -> str:
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(97, 123)) for _ in range(n))


# Small L1 and L2 (eight pages each) so that later prompts find their pages in every tier.
WORKLOAD = [_prompt(i) for i in range(3)] + [_prompt(0) + " and a new tail", _prompt(3), _prompt(1) + " again"]
WORKLOAD.append(WORKLOAD[-1] + " and again")  # from L1


class ThreadServer:
    """The server app under uvicorn in a thread, on a port the OS chose; ``stop`` ends it."""

    def __init__(self, server: KVTierServer) -> None:
        self.server = server
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]}, daemon=True)
        server.start()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)
        self.server.close()


@pytest.fixture(scope="module")
def served(loaded, tmp_path_factory):
    page = loaded.geometry(PAGE_TOKENS).nbytes
    store = StoreConfig(l1_bytes=8 * page, l2_bytes=8 * page, store_dir=tmp_path_factory.mktemp("dash-store"))
    engine = Engine(loaded, EngineConfig(page_size=PAGE_TOKENS, store=store))
    srv = ThreadServer(KVTierServer(engine, ServerConfig("kvtier-default", default_max_tokens=3)))
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        usages = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 3}).json()["usage"] for p in WORKLOAD]
        srv.usages = usages
        srv.http = http
        yield srv
    srv.stop()
