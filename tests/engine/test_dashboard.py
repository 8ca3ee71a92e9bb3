"""The dashboard's routes in process (starlette's TestClient, the generated tiny model):
the page and its files, the feed against ``/v1/kvtier/stats`` and each request's usage,
and the admin actions and their errors. The page itself runs in a browser in
``test_dashboard_browser``."""

from __future__ import annotations

import http.server
import json
import re
import socket
import threading

import numpy as np
import pytest
from rich.console import Console
from starlette.testclient import TestClient

from kvtier.engine.cli import top
from kvtier.engine.cli.common import UsageError
from kvtier.engine.cli.main import main
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.serve.admin import ADMIN_PREFIX
from kvtier.engine.serve.app import KVTierServer, ServerConfig
from kvtier.engine.serve.recent import RecentRequests
from kvtier.tiers.hierarchy import StoreConfig

from .conftest import text_prompt

ERROR_KEYS = {"message", "type", "param", "code"}
PAGE = 16


@pytest.fixture(scope="module")
def served(loaded, tmp_path_factory):
    page = loaded.geometry(PAGE).nbytes
    store = StoreConfig(l1_bytes=6 * page, l2_bytes=6 * page, store_dir=tmp_path_factory.mktemp("dash"))
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store))
    server = KVTierServer(engine, ServerConfig("kvtier-default", default_max_tokens=2))
    server.start()
    prompts = [text_prompt(loaded, 70, seed) for seed in range(3)]
    prompts += [prompts[0] + text_prompt(loaded, 9, 7), prompts[2] + text_prompt(loaded, 5, 8)]
    with TestClient(server.app, raise_server_exceptions=False) as client:
        client.usages = [
            client.post("/v1/completions", json={"prompt": p, "max_tokens": 2}).json()["usage"] for p in prompts
        ]
        client.prompts, client.server = prompts, server
        yield client
    server.close()


def _feed(client) -> dict:
    return client.get("/v1/kvtier/dashboard").json()


def _error(answer, status: int, param: str | None = None) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == ERROR_KEYS and error["param"] == param
    return error["message"]


def test_the_page_loads_only_its_own_files(served):
    root = served.get("/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/dashboard"
    page = served.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)  # nothing from anywhere else
    loaded = re.findall(r"(?:src|href)=\"(/[^\"]+)\"", page.text)
    assert {"/dashboard/static/chart.umd.min.js", "/dashboard/static/dashboard.js"} <= set(loaded)
    for path in loaded:
        answer = served.get(path)
        assert answer.status_code == 200 and answer.text, path
    assert served.get("/dashboard/static/chart.umd.min.js").text.startswith("/*!\n * Chart.js v4.")
    _error(served.get("/dashboard/static/app.py"), 404)  # only the page's files
    _error(served.get("/dashboard/static/..%2Fapp.py"), 404)


def test_the_feed_is_the_stats_endpoint_and_the_last_requests(served):
    stats = served.get("/v1/kvtier/stats").json()
    feed = _feed(served)
    stats.pop("windowed"), feed["stats"].pop("windowed")  # a rate that moves with the clock
    assert feed["stats"] == stats
    assert [r["rid"] for r in feed["requests"]] == sorted((r["rid"] for r in feed["requests"]), reverse=True)
    assert len(feed["requests"]) == len(served.usages)
    for record, usage in zip(reversed(feed["requests"]), served.usages):
        assert record["prompt_tokens"] == usage["prompt_tokens"]
        assert record["sources"] == usage["prompt_tokens_details"]["sources"]
        assert record["plan"] == usage["kvtier"]["plan"]
        assert "prompt" not in record and "text" not in str(record)  # no prompt in the public feed
        strip = {}
        for source, n in record["strip"]:
            strip[source] = strip.get(source, 0) + n
        assert strip == {s: n for s, n in record["sources"].items() if n}
        order = [source for source, _ in record["strip"]]
        assert "recomputed" not in order[:-1]  # restored tokens first, recomputed last
    assert any(r["strip"][0][0] != "recomputed" for r in feed["requests"])  # the workload restores


def test_the_latency_percentiles_are_those_of_the_last_requests(served):
    feed = _feed(served)
    ttfts = [r["ttft_s"] for r in feed["requests"]]
    queues = [r["queue_s"] for r in feed["requests"]]
    latency = feed["latency"]
    assert latency["requests"] == len(ttfts)
    assert latency["ttft_p50_s"] == pytest.approx(np.percentile(ttfts, 50))
    assert latency["ttft_p95_s"] == pytest.approx(np.percentile(ttfts, 95))
    assert latency["queue_p95_s"] == pytest.approx(np.percentile(queues, 95))
    assert RecentRequests().latency(0.0)["ttft_p50_s"] is None  # nothing ended: no figure


def test_the_operator_reads_a_requests_tokens(served):
    record = _feed(served)["requests"][-1]  # the first request
    answer = served.get(f"{ADMIN_PREFIX}/requests/{record['rid']}/tokens").json()
    tokenizer = served.server.tokenizer
    assert [t["text"] for t in answer["tokens"]] == [tokenizer.decode([t]) for t in served.prompts[0]]
    assert [t["source"] for t in answer["tokens"]] == [s for s, n in record["strip"] for _ in range(n)]
    _error(served.get(f"{ADMIN_PREFIX}/requests/99999/tokens"), 404, "rid")


def test_pin_and_unpin_a_requests_prompt(served):
    record = _feed(served)["requests"][0]
    pinned = served.post(f"{ADMIN_PREFIX}/pin", json={"rid": record["rid"]}).json()
    assert pinned["pages"] > 0
    assert _feed(served)["pins"] == [{"rid": record["rid"], "pages": pinned["pages"]}]
    assert len(served.server.engine.store.accounts.view().pins) >= pinned["pages"]
    assert served.post(f"{ADMIN_PREFIX}/unpin", json={"rid": record["rid"]}).json()["pages"] == pinned["pages"]
    assert _feed(served)["pins"] == [] and len(served.server.engine.store.accounts.view().pins) == 0
    _error(served.post(f"{ADMIN_PREFIX}/unpin", json={"rid": record["rid"]}), 404, "rid")
    _error(served.post(f"{ADMIN_PREFIX}/pin", json={"rid": 99999}), 404, "rid")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("pin", b"not json", None),
        ("pin", b"[1]", None),
        ("pin", b"{}", "rid"),
        ("pin", b'{"rid": "1"}', "rid"),
        ("unpin", b'{"rid": true}', "rid"),
        ("resize", b'{"l3_bytes": 0}', "l3_bytes"),
        ("resize", b'{"l3_bytes": 1.5}', "l3_bytes"),
        ("resize", b'{"l3_bytes": 5, "shrink": true}', "shrink"),
        ("clear", b'{"namespace": 3}', "namespace"),
        ("clear", b'{"namespace": "zz"}', "namespace"),
        ("clear", b'{"namespace": ""}', "namespace"),
    ],
)
def test_a_bad_action_is_one_400(served, path, body, param):
    message = _error(served.post(f"{ADMIN_PREFIX}/{path}", content=body), 400, param)
    assert "\n" not in message


def test_resize_then_clear_the_namespace(served):
    store = served.server.engine.store
    store.keeping.flush()  # every page in L3 now
    namespaces = _feed(served)["namespaces"]
    assert len(namespaces) == 1 and namespaces[0]["current"] and namespaces[0]["pages"] > 0
    l3 = store.stats().tiers["L3"]
    assert namespaces[0]["pages"] == l3.pages and namespaces[0]["bytes"] == l3.bytes_used
    resized = served.post(f"{ADMIN_PREFIX}/resize", json={"l3_bytes": 64 << 20}).json()
    assert resized["l3_bytes"] == 64 << 20 and _feed(served)["stats"]["tiers"]["L3"]["capacity"] == 64 << 20
    cleared = served.post(f"{ADMIN_PREFIX}/clear", json={"namespace": namespaces[0]["namespace"][:8]}).json()
    assert cleared["pages"] == namespaces[0]["pages"]
    assert _feed(served)["namespaces"] == [] and store.stats().tiers["L3"].pages == 0


def test_without_a_store_the_actions_say_so(loaded):
    server = KVTierServer(Engine(loaded, EngineConfig(page_size=PAGE)), ServerConfig("kvtier-default"))
    with TestClient(server.app) as client:
        assert _feed(client)["namespaces"] == []
        _error(client.post(f"{ADMIN_PREFIX}/clear", json={"namespace": "ab"}), 409)
        _error(client.post(f"{ADMIN_PREFIX}/resize", json={"l3_bytes": 1 << 20}), 409)
    server.close()


def test_top_draws_the_feed(served):
    feed = _feed(served)
    console = Console(record=True, width=200, color_system="truecolor")
    console.print(top.view(feed, feed))
    text = console.export_text()
    for name, tier in feed["stats"]["tiers"].items():
        assert re.search(rf"{name}\s.*\s{tier['pages']}\s+.*{tier['hit_pages']}\s.*\s{tier['evictions']}\s", text), name
    for record in feed["requests"][: top.SHOWN_REQUESTS]:
        assert re.search(rf"\b{record['rid']}\s+.*{record['prompt_tokens']}\s", text)
    sources = feed["stats"]["engine"]["sources"]
    assert f"{(sum(sources.values()) - sources['recomputed']) / sum(sources.values()):.1%}" in text


@pytest.mark.parametrize("runs", [[["L3", 32], ["L2", 64], ["recomputed", 39]], [["L1", 239], ["recomputed", 1]]])
def test_tops_strip_scales_each_run_to_the_terminal(runs):
    tokens = sum(n for _, n in runs)
    cells = top.strip(runs, tokens, width=40)
    assert len(cells.plain) == 40
    for source, n in runs:
        drawn = sum(span.end - span.start for span in cells.spans if span.style == top.STYLES[source])
        assert abs(drawn - 40 * n / tokens) <= 1, source


@pytest.mark.parametrize("url", ["ftp://host", "http://host:port", "http://", "127.0.0.1:{closed}"])
def test_a_bad_url_for_top_is_one_error_line(url, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once closed
    assert main(["top", "--once", url.format(closed=closed)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and err.count("\n") == 1


def test_top_sends_its_api_key_and_says_when_one_is_needed():
    """Against a server that answers its feed only to ``Bearer k`` (as a keyed kvtier
    server does to an admin key): without the key one error line, with it the feed."""

    class Keyed(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            ok = self.headers.get("Authorization") == "Bearer k"
            body = json.dumps({"stats": {}, "time": 0} if ok else {"error": {}}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Keyed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = top.feed_url(f"127.0.0.1:{server.server_address[1]}")
    try:
        with pytest.raises(UsageError, match="answered 401: it needs an admin API key"):
            top.fetch(url)
        assert top.fetch(url, "k")["stats"] == {}
    finally:
        server.shutdown()
