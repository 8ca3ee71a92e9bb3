"""``GET /v1/kvtier/events`` (DESIGN §11) on a real server in this process (uvicorn on a
free 127.0.0.1 port, the small generated model): the hello is what the store holds, a
request's pages arrive keyed as ``key_chain`` keys them, an eviction shows in both
tiers, the hello plus the changes after it is what a later hello lists, load changes
while requests run, the route needs an admin key, and a reader that falls behind is cut
off without holding up the engine."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.engine.serve.events import EVENTS_PATH, Load, engine_load
from kvtier.engine.serve.tenancy import Caller, Tenancy
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.page import key_chain, reusable_pages

from .conftest import text_prompt
from .dashboard_server import ThreadServer

PAGE = 16
WAIT_S = 30.0


def _server(loaded, l1_pages: int, l2_pages: int, keys: dict[str, Caller] | None = None, **config) -> ThreadServer:
    page = loaded.geometry(PAGE).nbytes
    store = StoreConfig(l1_bytes=l1_pages * page, l2_bytes=l2_pages * page, store_dir=None)
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store))
    tenancy = Tenancy(keys, bytes(32), engine.root, PAGE) if keys else None
    return ThreadServer(KVTierServer(engine, ServerConfig("kvtier-tiny", **config), tenancy))


@pytest.fixture
def served(loaded):
    srv = _server(loaded, 4, 16)
    yield srv
    srv.stop()


def _events(lines: Iterator[str]) -> Iterator[tuple[str, dict]]:
    """(name, data) of each server-sent event on ``lines``."""
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            assert name is not None, "data before its event line"
            yield name, json.loads(line[len("data: ") :])
            name = None


class Reader:
    """One events connection, read on a thread of its own into a list (so that a test can
    send requests meanwhile and wait for what it expects). A plain socket: ``close`` shuts
    it down at once, as a router that goes away does, whatever the reading thread does."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.got: list[tuple[str, dict]] = []
        self.ended = threading.Event()
        host, port = url.removeprefix("http://").split(":")
        self._sock = socket.create_connection((host, int(port)), timeout=WAIT_S)
        lines = [f"GET {EVENTS_PATH} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self._sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self._file = self._sock.makefile("rb")
        status = self._file.readline().split()
        assert status[1] == b"200", status
        head = dict(line.decode().lower().rstrip("\r\n").split(": ", 1) for line in iter(self._file.readline, b"\r\n"))
        assert head["content-type"].startswith("text/event-stream") and head["transfer-encoding"] == "chunked"
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        self.hello = self.wait(lambda got: got)[0][1]

    def _lines(self) -> Iterator[str]:
        """The body's lines, its chunked encoding undone; ends with the stream."""
        text = ""
        while size := int(self._file.readline().strip() or b"0", 16):
            text += self._file.read(size).decode()
            self._file.readline()  # the CRLF after a chunk
            *done, text = text.split("\n")
            yield from done

    def _read(self) -> None:
        try:
            for event in _events(self._lines()):
                self.got.append(event)
        except (OSError, ValueError):
            pass  # closed by the test
        finally:
            self.ended.set()

    def wait(self, done, what: str = "the events expected") -> list[tuple[str, dict]]:
        deadline = time.monotonic() + WAIT_S
        while not done(self.got):
            assert time.monotonic() < deadline, f"no {what} within {WAIT_S} s: {self.got}"
            time.sleep(0.02)
        return list(self.got)

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(WAIT_S)


def _tiers(reader: Reader, events: list[tuple[str, dict]]) -> dict[str, set[str]]:
    """The hello's pages with every ``pages`` event after it applied: what the reader
    believes each tier holds."""
    held = {tier: set(keys) for tier, keys in reader.hello["pages"].items()}
    for name, data in events[1:]:
        if name == "pages":
            assert not set(data["stored"]) & set(data["evicted"])
            held[data["tier"]] = (held[data["tier"]] - set(data["evicted"])) | set(data["stored"])
    return held


def _complete(srv: ThreadServer, prompt: list[int], max_tokens: int = 1) -> dict:
    answer = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=WAIT_S)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _keys(srv: ThreadServer, prompt: list[int]) -> list[str]:
    engine = srv.server.engine
    return [k.hex() for k in key_chain(engine.namespace, prompt).keys[: reusable_pages(len(prompt), PAGE)]]


def test_hello_is_what_the_store_holds(served, loaded):
    prompts = [text_prompt(loaded, 3 * PAGE + 5, seed) for seed in range(2)]  # 6 pages: 4 fit in L1
    for prompt in prompts:
        _complete(served, prompt)
    reader = Reader(served.url)
    hello = reader.hello
    reader.close()
    engine = served.server.engine
    assert hello["seq"] == 0 and len(hello["epoch"]) == 16
    assert hello["namespace"]["model_fingerprint"] == engine.namespace.model_fingerprint
    assert (hello["page_size"], hello["page_bytes"]) == (PAGE, engine.geometry.nbytes)
    assert hello["profile"] == engine.profile.to_dict()
    assert hello["load"] == {"running": 0, "waiting": 0, "pending_tokens": 0}
    tiers = httpx.get(served.url + "/v1/kvtier/stats", timeout=WAIT_S).json()["tiers"]
    assert len(hello["pages"]["L2"]) == tiers["L2"]["pages"] > 0  # L2 holds whole pages only
    assert engine.store is not None
    everything = set()
    for prompt in prompts:
        keys = key_chain(engine.namespace, prompt).keys[: reusable_pages(len(prompt), PAGE)]
        found = engine.store.locate(keys, prompt)
        assert len(found) == len(keys)  # L1 and L2 hold every page: the hello lists each where it is
        for key, source in zip(keys, found):
            assert key.hex() in hello["pages"][source.value]
        everything |= {k.hex() for k in keys}
    assert set(hello["pages"]["L1"]) | set(hello["pages"]["L2"]) == everything
    assert 0 < len(hello["pages"]["L1"]) < tiers["L1"]["pages"]  # L1's partial pages are not listed


def test_a_requests_pages_arrive_keyed_by_their_chain_and_evictions_move_them(served, loaded):
    reader = Reader(served.url)
    first = text_prompt(loaded, 3 * PAGE + 5, 1)
    _complete(served, first)
    keys = set(_keys(served, first))
    events = reader.wait(lambda got: keys <= _tiers(reader, got)["L1"], "pages of the first request")
    assert _tiers(reader, events) == {"L1": keys, "L2": set()}
    assert all(data["seq"] == i and data["epoch"] == reader.hello["epoch"] for i, (_, data) in enumerate(events))

    second = text_prompt(loaded, 3 * PAGE + 5, 2)  # 3 more pages and a partial one: L1 holds 4 in all
    _complete(served, second)
    more = set(_keys(served, second))

    def settled(got) -> bool:  # the second request's pages arrived, and each page L1 let go has arrived in L2
        held = _tiers(reader, got)
        return more <= held["L1"] | held["L2"] and keys - held["L1"] <= held["L2"]

    events = reader.wait(settled, "the eviction")
    held = _tiers(reader, events)
    moved = keys - held["L1"]
    assert moved and moved <= held["L2"]  # evicted from L1, stored in L2
    evicted = {k for name, d in events if name == "pages" and d["tier"] == "L1" for k in d["evicted"]}
    assert moved <= evicted
    time.sleep(0.2)  # a page event comes at most 50 ms after its change
    later = Reader(served.url)
    reader.close()
    later.close()
    assert _tiers(reader, reader.got) == {tier: set(keys) for tier, keys in later.hello["pages"].items()}


def test_load_changes_while_requests_run(served, loaded):
    reader = Reader(served.url)
    prompts = [text_prompt(loaded, 2 * PAGE, 10 + i) for i in range(3)]
    threads = [threading.Thread(target=_complete, args=(served, p, 16)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    def busy_then_idle(got: list[tuple[str, dict]]) -> bool:
        loads = [d["running"] for n, d in got if n == "load"]
        return any(n > 0 for n in loads) and loads[-1] == 0

    events = reader.wait(busy_then_idle, "load while running, then idle")
    loads = [d for n, d in events if n == "load"]
    assert all(d["pending_tokens"] <= len(prompts) * 2 * PAGE for d in loads)
    assert {k: v for k, v in loads[-1].items() if k not in ("seq", "epoch")} == {
        "running": 0,
        "waiting": 0,
        "pending_tokens": 0,
    }
    reader.close()


def test_load_counts_the_queue_and_the_prompt_tokens_not_prefilled(loaded):
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(store_dir=None)))
    prompts = [text_prompt(loaded, 2 * PAGE + i, 20 + i) for i in range(2)]
    for prompt in prompts:
        engine.submit(prompt, SamplingParams(max_tokens=1))
    assert engine_load(engine) == Load(running=0, waiting=2, pending_tokens=sum(map(len, prompts)))
    engine.run()
    assert engine_load(engine) == Load(0, 0, 0)
    engine.close()


def test_an_idle_stream_beats_every_two_seconds(served):
    reader = Reader(served.url)
    events = reader.wait(lambda got: any(n == "load" for n, _ in got), "a heartbeat")
    reader.close()
    assert [n for n, _ in events] == ["hello", "load"]
    assert events[1][1]["running"] == 0


def test_the_route_needs_an_admin_key_when_keys_are_set(loaded):
    keys = {"key-user": Caller("alice"), "key-admin": Caller("ops", admin=True)}
    srv = _server(loaded, 4, 4, keys)
    try:
        for headers, status, kind in (
            ({}, 401, "authentication_error"),
            ({"Authorization": "Bearer key-user"}, 403, "permission_error"),
        ):
            with httpx.stream("GET", srv.url + EVENTS_PATH, headers=headers, timeout=WAIT_S) as answer:
                assert answer.status_code == status  # checked before the body: a stream never ends
                error = json.loads(answer.read())["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == kind
        reader = Reader(srv.url, {"x-api-key": "key-admin"})
        assert reader.hello["pages"] == {"L1": [], "L2": []}
        reader.close()
    finally:
        srv.stop()


def test_a_reader_that_falls_behind_is_cut_off_and_the_engine_goes_on(loaded):
    srv = _server(loaded, 4, 16, events_queue=2)
    try:
        reader = Reader(srv.url)
        prompt = text_prompt(loaded, 8 * PAGE + 3, 3)  # 8 pages at once: past the bound of 2
        usage = _complete(srv, prompt)["usage"]
        assert usage["prompt_tokens"] == len(prompt)
        assert reader.ended.wait(WAIT_S), "the stream of a reader past its bound did not end"
        reader.close()
        again = Reader(srv.url)  # reconnecting gives a fresh snapshot
        assert set(again.hello["pages"]["L1"]) | set(again.hello["pages"]["L2"]) == set(_keys(srv, prompt))
        again.close()
    finally:
        srv.stop()
