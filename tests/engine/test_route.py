"""``kvtier route``'s parts without processes: a backend's event stream applied to its
index (gaps resync), the policies over hand-made backends (the cache-aware one is
``costmodel.fleet.choose``; prefix single flight across engines), and the proxy over an
in-memory transport (retries before the answer starts, an error event after, the deadline)."""

from __future__ import annotations

import json
import socket
from dataclasses import asdict

import anyio
import httpx
import pytest

from kvtier.costmodel.profile import Profile
from kvtier.engine.route.backend import Backend, Resync
from kvtier.engine.route.placement import Placer, Policy
from kvtier.engine.route.proxy import BACKEND_HEADER, Outgoing, Proxy
from kvtier.engine.route.stream import sse_events
from kvtier.tiers.page import Namespace, key_chain

from .. import cli

PAGE = 4
NAMESPACE = Namespace("fingerprint", "float16", PAGE)
PROMPT = list(range(100, 133))  # 33 tokens: 8 reusable pages
KEYS = [bytes(k) for k in key_chain(NAMESPACE, PROMPT).keys]


def hello(l1=(), l2=(), running=0, waiting=0, pending=0, epoch="e1") -> dict:
    return {
        "seq": 0,
        "epoch": epoch,
        "namespace": asdict(NAMESPACE),
        "page_size": PAGE,
        "page_bytes": 4096,
        "profile": Profile.defaults().to_dict(),
        "pages": {"L1": [k.hex() for k in l1], "L2": [k.hex() for k in l2]},
        "load": {"running": running, "waiting": waiting, "pending_tokens": pending},
    }


def backend(name: str, **kw) -> Backend:
    b = Backend(f"http://{name}:1", "fingerprint")
    b.healthy = True
    b.apply("hello", hello(**kw))
    return b


def sources(b: Backend) -> list[str | None]:
    return [None if (s := b.index.where(k)) is None else s.value for k in KEYS[:3]]


def test_the_stream_keeps_the_index_and_a_gap_or_another_epoch_resyncs():
    b = backend("a", l1=KEYS[:1])
    b.apply("pages", {"seq": 1, "epoch": "e1", "tier": "L1", "stored": [KEYS[1].hex()], "evicted": []})
    b.apply("pages", {"seq": 2, "epoch": "e1", "tier": "L1", "stored": [], "evicted": [KEYS[0].hex()]})
    b.apply("pages", {"seq": 3, "epoch": "e1", "tier": "L2", "stored": [KEYS[0].hex(), KEYS[1].hex()], "evicted": []})
    assert sources(b) == ["L2", "L2", None]  # moved down: gone from L1, in L2
    b.apply("pages", {"seq": 4, "epoch": "e1", "tier": "L2", "stored": [], "evicted": [KEYS[1].hex()]})
    assert sources(b) == ["L2", None, None]  # dropped from L2
    b.apply("load", {"seq": 5, "epoch": "e1", "running": 2, "waiting": 3, "pending_tokens": 50})
    assert (b.load, b.pending_tokens) == (5, 50)
    with pytest.raises(Resync):  # seq 7 after 5
        b.apply("load", {"seq": 7, "epoch": "e1", "running": 0, "waiting": 0, "pending_tokens": 0})
    b.lost()
    assert sources(b) == [None, None, None] and not b.keyed
    with pytest.raises(Resync):  # nothing follows until a hello
        b.apply("load", {"seq": 6, "epoch": "e1", "running": 0, "waiting": 0, "pending_tokens": 0})
    b.apply("hello", hello(l1=KEYS[2:3], epoch="e2"))
    assert sources(b) == [None, None, "L1"] and b.view()["resyncs"] == 1
    with pytest.raises(Resync):  # the old epoch's events are not this server's
        b.apply("load", {"seq": 1, "epoch": "e1", "running": 0, "waiting": 0, "pending_tokens": 0})


def test_a_backend_of_another_model_is_not_keyed():
    b = Backend("http://other:1", "another fingerprint")
    b.apply("hello", hello(l1=KEYS))
    assert not b.keyed and sources(b) == [None, None, None]


def test_server_sent_events_are_parsed_and_data_that_is_not_an_object_resyncs():
    async def lines(*items):
        for item in items:
            yield item

    async def parse(*items):
        return [e async for e in sse_events(lines(*items))]

    got = anyio.run(parse, ": comment", "event: load", 'data: {"seq": 1,', 'data: "x": 2}', "", "event: empty", "")
    assert got == [("load", {"seq": 1, "x": 2})]
    with pytest.raises(Resync):
        anyio.run(parse, "event: hello", "data: [1]", "")


def place(placer: Placer, tokens=PROMPT, exclude=()):
    return anyio.run(placer.place, tokens, exclude)


def test_cache_aware_goes_where_the_prefix_is_and_round_robin_and_least_load_do_what_they_say():
    a, b, c = backend("a"), backend("b", l1=KEYS), backend("c", running=1)
    aware = Placer([a, b, c], Policy.CACHE_AWARE, max_imbalance=4)
    ticket = place(aware)
    assert ticket.backend is b and ticket.reason == "fastest"
    ticket.end()
    rr = Placer([a, b, c], Policy.ROUND_ROBIN, 4)
    turns = [place(rr) for _ in range(4)]
    assert [t.backend for t in turns] == [a, b, c, a]
    for t in turns:
        t.end()
    least = Placer([c, b, a], Policy.LEAST_LOAD, 4)
    assert place(least).backend is b  # c has one running; b and a none: the first given this turn
    assert place(least).backend is a  # b now has the router's own request outstanding
    assert place(Placer([a, b], Policy.CACHE_AWARE, 4), exclude={a.name, b.name}) is None


@pytest.mark.parametrize("policy", [Policy.LEAST_LOAD, Policy.CACHE_AWARE])
def test_an_idle_fleet_s_ties_go_to_each_backend_in_turn(policy):
    backends = [backend(name) for name in "abc"]
    placer = Placer(backends, policy, 4)
    chosen = []
    for i in range(6):
        ticket = place(placer, [i * 1000 + t for t in PROMPT])  # a prompt no backend holds
        ticket.end()  # done before the next: every backend idle again
        chosen.append(ticket.backend)
    assert chosen == backends + backends


def test_a_burst_of_one_new_prefix_goes_to_one_backend_within_the_load_bound():
    backends = [backend(name) for name in "abc"]
    placer = Placer(backends, Policy.CACHE_AWARE, max_imbalance=2)
    tickets = [place(placer) for _ in range(5)]
    first = tickets[0].backend
    # the leader's pages are in flight there: followers go there too, until it is 2 ahead
    assert [t.backend is first for t in tickets[:3]] == [True, True, True]
    assert all(t.backend is not first for t in tickets[3:])
    for t in tickets:
        t.end()
    assert first.index.sizes()["in_flight"] == 0 and first.outstanding == 0
    ticket = place(placer)  # nothing in flight any more, nothing published: any backend
    assert ticket.reason == "fastest"


def test_published_pages_stop_being_in_flight_and_an_ended_request_lands_its_pages():
    a = backend("a")
    placer = Placer([a], Policy.CACHE_AWARE, 4)
    ticket = place(placer)
    assert a.index.sizes()["in_flight"] == len(KEYS)
    a.apply("pages", {"seq": 1, "epoch": "e1", "tier": "L1", "stored": [k.hex() for k in KEYS[:2]], "evicted": []})
    assert a.index.sizes() == {"L1": 2, "L2": 0, "in_flight": len(KEYS) - 2}
    ticket.end()  # it failed before an answer: its pages land at once
    ticket.end()  # once only
    assert a.index.sizes() == {"L1": 2, "L2": 0, "in_flight": 0} and a.outstanding == 0
    served = place(placer)
    served.answering()
    served.end()  # served: its pages stay in flight until published (or the grace period)
    assert a.index.sizes()["in_flight"] == len(KEYS) - 2 and a.outstanding == 0


def load_event(b: Backend, seq: int, pending: int = 0) -> None:
    b.apply("load", {"seq": seq, "epoch": "e1", "running": 0, "waiting": 0, "pending_tokens": pending})


def test_a_streamed_answer_s_prompt_stays_pending_until_the_backend_reports_it():
    # kvtier serve starts a streamed answer (its first chunk) before the prefill: the prompt
    # is still to compute there, and the next report may have left before the request came
    a, b = backend("a"), backend("b")
    placer = Placer([a, b], Policy.CACHE_AWARE, 4)
    ticket = place(placer)
    ticket.answering()
    assert ticket.tokens == len(PROMPT) and ticket.backend.pending_tokens == len(PROMPT)
    load_event(ticket.backend, 1)  # it may predate the request
    assert ticket.backend.pending_tokens == len(PROMPT)
    other = list(range(500, 533))  # another prompt: nothing of it in flight there
    assert place(placer, other).backend is not ticket.backend  # its queue is priced: the other is sooner
    load_event(ticket.backend, 2, pending=7)  # the backend's own count has it now
    assert ticket.backend.pending_tokens == 7
    ticket.end()
    assert ticket.backend.outstanding == 0


# -- the proxy ---------------------------------------------------------------------


class Body(httpx.AsyncByteStream):
    """An answer's bytes as a backend streams them; ``broken``: the connection breaks after them."""

    def __init__(self, data: bytes, broken: bool = False) -> None:
        self.data, self.broken = data, broken

    async def __aiter__(self):
        yield self.data
        if self.broken:
            raise httpx.ReadError("connection reset")


def answer(status: int, data: bytes, content_type: str = "application/json", broken: bool = False) -> httpx.Response:
    return httpx.Response(status, headers={"content-type": content_type}, stream=Body(data, broken))


def fleet(handler, *names, deadline=5.0) -> tuple[Proxy, list[Backend]]:
    backends = [backend(n) for n in names]
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return Proxy(client, Placer(backends, Policy.ROUND_ROBIN, 4), deadline), backends


async def collect(proxy: Proxy, path: str = "/v1/chat/completions", anthropic: bool = False):
    response = await proxy.forward(Outgoing("POST", path, {"authorization": "Bearer k"}, b"{}", anthropic), None)
    if not hasattr(response, "body_iterator"):  # the router's own answer
        return response, response.body
    body = b"".join([chunk async for chunk in response.body_iterator])
    return response, body


def test_a_request_is_retried_until_a_backend_answers_and_the_answer_is_passed_through():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers["authorization"]))
        if request.url.host == "a":
            raise httpx.ConnectError("refused")
        if request.url.host == "b":
            return answer(503, b'{"error": {"message": "stopping"}}')
        return answer(200, b'{"ok": 1}')

    proxy, (a, b, c) = fleet(handler, "a", "b", "c")
    response, body = anyio.run(collect, proxy)
    assert (response.status_code, body, response.headers[BACKEND_HEADER]) == (200, b'{"ok": 1}', c.name)
    assert seen == [("a", "Bearer k"), ("b", "Bearer k"), ("c", "Bearer k")]
    assert not a.healthy and b.healthy  # refused: out at once; a 503 is an answer
    assert proxy.view()["retries"] == 2 and all(x.outstanding == 0 for x in (a, b, c))


def test_when_no_backend_takes_it_the_last_refusal_or_a_503_goes_back():
    proxy, _ = fleet(lambda r: answer(429, b'{"error": {"message": "full"}}'), "a", "b")
    response, body = anyio.run(collect, proxy)
    assert response.status_code == 429 and json.loads(body)["error"]["message"] == "full"

    def refused(request):
        raise httpx.ConnectError("refused")

    proxy, _ = fleet(refused, "a", "b")
    response, body = anyio.run(collect, proxy, "/v1/messages", True)
    assert response.status_code == 503
    assert json.loads(body) == {
        "type": "error",
        "error": {
            "message": "no backend could take the request (2 tried)",
            "type": "overloaded_error",
            "param": None,
            "code": "no_backend",
        },
    }


def test_a_stream_broken_after_it_started_ends_with_an_error_event_and_is_not_retried():
    calls = []

    def handler(request):
        calls.append(request.url.host)
        return answer(200, b"data: {}\n\n", "text/event-stream", broken=True)

    proxy, _ = fleet(handler, "a", "b")
    response, body = anyio.run(collect, proxy)
    assert calls == ["a"] and response.status_code == 200
    first, error, done = body.decode().split("\n\n")[:3]
    assert first == "data: {}" and json.loads(error[len("data: ") :])["error"]["type"] == "api_error"
    assert done == "data: [DONE]"


def test_no_client_waits_past_the_deadline():
    async def slow(request):
        await anyio.sleep(30)
        return answer(200, b"late")

    proxy, backends = fleet(slow, "a", deadline=0.3)
    response, body = anyio.run(collect, proxy)
    assert response.status_code == 504 and json.loads(body)["error"]["code"] == "deadline"
    assert backends[0].outstanding == 0


def test_a_backend_taken_out_while_waited_on_is_given_up_for_another():
    async def handler(request):
        if request.url.host == "a":
            backends[0].healthy = False  # what the health checks do to a hung backend
            await anyio.sleep(30)
        return answer(200, b"ok")

    proxy, backends = fleet(handler, "a", "b")
    response, body = anyio.run(collect, proxy)
    assert (body, response.headers[BACKEND_HEADER]) == (b"ok", backends[1].name)


BAD_FLAGS = [
    (["route"], "--backend"),
    (["route", "--backend", "localhost:8000"], "http://HOST:PORT"),
    (["route", "--backend", "http://h:1/v1"], "http://HOST:PORT"),
    (["route", "--backend", "http://h:99999"], "out of range"),
    (["route", "--backend", "http://h:1", "--backend", "http://h:1"], "given twice"),
    (["route", "--backend", "http://h:1", "--policy", "random"], "invalid choice"),
    (["route", "--backend", "http://h:1", "--max-imbalance", "-1"], "whole number"),
    (["route", "--backend", "http://h:1", "--deadline", "0"], "more than 0"),
    (["route", "--backend", "http://h:1", "--l3-redis", "/tmp/x"], "redis://"),
]


@pytest.mark.parametrize("argv, words", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_are_one_line_and_exit_2(argv, words):
    with socket.socket() as busy:  # a router that got past its flags stops at the port, not serving
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        done = cli.run([*argv, "--port", str(busy.getsockname()[1])])
    assert done.returncode == 2 and words in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("kvtier: error: ") or "usage:" in done.stderr
