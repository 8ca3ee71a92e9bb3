"""A fleet on 127.0.0.1: three ``kvtier serve`` backends (the small generated model,
small pages) sharing one ``redis-server`` as L3, and ``kvtier route`` in front of them,
all on free ports. Placement is read from the ``x-kvtier-backend`` header and the
backends' usage labels (where each prompt token came from)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from ..readme_blocks import Background
from ..redis_servers import RedisServer, needs_redis
from .conftest import mlx_lm_greedy, text_prompt, wait_until

pytestmark = [pytest.mark.slow, needs_redis]  # starts processes

PAGE = 16
TINY = "kvtier-tiny"


class Child(Background):
    """A ``kvtier`` command in a child process that prints its URL (`` on http://...``) once it listens."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "kvtier.engine.cli", *args]
        super().__init__(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ)))

    def wait_listening(self, timeout: float = 180) -> Child:
        self.url = self.wait_for(r" on (http://\S+)", timeout).group(1)
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def backend(store: str, port: int = 0) -> Child:
    return Child(
        "serve", "--model", TINY, "--store", store, "--page-size", str(PAGE), "--max-running", "1", "--port", str(port)
    )


def router(backends: list[str], *flags: str) -> Child:
    return Child("route", "--model", TINY, "--port", "0", *(f for url in backends for f in ("--backend", url)), *flags)


class Fleet:
    def __init__(self, redis: RedisServer) -> None:
        self.redis = redis
        self.backends = [backend(redis.url) for _ in range(3)]
        for child in self.backends:
            child.wait_listening()
        self.urls = [child.url for child in self.backends]
        self.router = self.start_router()
        self.http = httpx.Client(timeout=120)

    def start_router(self, *flags: str) -> Child:
        child = router(self.urls, "--l3-redis", self.redis.url, *flags).wait_listening()
        wait_until(lambda: all(b["synced"] for b in self.view(child)["backends"]), "every backend's hello came")
        return child

    def view(self, child: Child | None = None) -> dict:
        return httpx.get((child or self.router).url + "/v1/kvtier/route", timeout=10).json()

    def idle(self, child: Child | None = None) -> None:
        def quiet(b: dict) -> bool:
            return not any(b["load"][k] for k in ("running", "waiting", "pending_tokens", "outstanding"))

        wait_until(lambda: all(quiet(b) for b in self.view(child)["backends"]), "every backend is idle")

    def backend_view(self, url: str, child: Child | None = None) -> dict:
        return next(b for b in self.view(child)["backends"] if b["url"] == url)

    def post(self, path: str, body: dict, child: Child | None = None) -> httpx.Response:
        response = self.http.post((child or self.router).url + path, json=body)
        assert response.status_code == 200, response.text
        return response


@pytest.fixture(scope="module")
def fleet():
    with tempfile.TemporaryDirectory() as directory:
        redis = RedisServer(Path(directory), "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru")
        built = Fleet(redis)
        try:
            yield built
        finally:
            built.http.close()
            for child in [built.router, *built.backends]:
                child.stop()
            redis.stop()


def chat(messages: list[dict], max_tokens: int = 8) -> dict:
    return {"model": TINY, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


SYSTEM = "You are a careful assistant who answers in short sentences about caches and pages and tiers. " * 3


def test_a_conversations_next_turn_lands_where_it_was_served_even_through_a_restarted_router(fleet):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a page of KV cache?"}]
    first = fleet.post("/v1/chat/completions", chat(messages))
    served = first.headers["x-kvtier-backend"]
    wait_until(lambda: fleet.backend_view(served)["pages"]["L1"] > 0, "the backend published its pages")
    fleet.router.stop()
    fleet.router = fleet.start_router()  # it rebuilds every index from the streams
    assert fleet.backend_view(served)["pages"]["L1"] > 0
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "And a tier?"}]
    second = fleet.post("/v1/chat/completions", chat(messages))
    assert second.headers["x-kvtier-backend"] == served
    usage = second.json()["usage"]
    sources = usage["prompt_tokens_details"]["sources"]
    assert sources["L1"] >= usage["prompt_tokens"] // 2 and sources["L3"] == 0


def test_a_burst_of_one_new_prefix_goes_to_one_backend_first_and_the_rest_follow(fleet):
    prefix = "Burst. " + "A new system prompt nobody sent before, about eviction and admission. " * 4
    bodies = [
        chat([{"role": "system", "content": prefix}, {"role": "user", "content": f"Question {i}?"}], 4)
        for i in range(3)
    ]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda b: fleet.post("/v1/chat/completions", b), bodies))
    assert len({a.headers["x-kvtier-backend"] for a in answers}) == 1, fleet.view()
    usages = [a.json()["usage"] for a in answers]
    recomputed = sum(u["prompt_tokens_details"]["sources"]["recomputed"] for u in usages)
    prompt = min(u["prompt_tokens"] for u in usages)
    assert recomputed < 2 * prompt  # the shared prefix computed once, not three times


def test_round_robin_and_least_load_do_what_they_say(fleet, loaded):
    rr, least = fleet.start_router("--policy", "round-robin"), fleet.start_router("--policy", "least-load")
    try:
        body = chat([{"role": "user", "content": "Where does this go?"}], 2)
        assert [fleet.post("/v1/chat/completions", body, rr).headers["x-kvtier-backend"] for _ in range(4)] == [
            *fleet.urls,
            fleet.urls[0],
        ]
        fleet.idle(least)  # the backends' load reports say so too (they come every 100 ms)
        assert fleet.post("/v1/chat/completions", body, least).headers["x-kvtier-backend"] == fleet.urls[0]
        fleet.idle(least)
        # three at once, each long enough to run while the others are placed (no end of text before max_tokens)
        no_eos = {str(loaded.tokenizer.eos_token_id): -100}
        bodies = [
            {"model": TINY, "prompt": text_prompt(loaded, 400, seed=40 + i), "max_tokens": 100, "logit_bias": no_eos}
            for i in range(3)
        ]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda b: fleet.post("/v1/completions", b, least), bodies))
        assert sorted(a.headers["x-kvtier-backend"] for a in answers) == sorted(fleet.urls)
        assert fleet.view(least)["reasons"] == {"least-load": 4}
    finally:
        rr.stop()
        least.stop()


def test_a_killed_backends_waiting_requests_finish_elsewhere_and_a_restarted_one_rejoins(fleet, loaded):
    prompt = text_prompt(loaded, 12 * PAGE, seed=30)
    expected = loaded.tokenizer.decode(mlx_lm_greedy(loaded, prompt, 48))
    body = {"model": TINY, "prompt": prompt, "max_tokens": 48, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        sent = [pool.submit(fleet.http.post, fleet.router.url + "/v1/completions", json=body) for _ in range(3)]
        victim = wait_until(
            lambda: next((b["url"] for b in fleet.view()["backends"] if b["load"]["outstanding"] == 3), None),
            "the three requests are on one backend",
        )
        index = fleet.urls.index(victim)
        epoch = fleet.backend_view(victim)["epoch"]
        fleet.backends[index].kill()
        answers = [future.result() for future in sent]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.json()["choices"][0]["text"] for a in answers] == [expected] * 3
    assert all(a.headers["x-kvtier-backend"] != victim for a in answers)
    assert fleet.view()["retries"] >= 1 and not fleet.backend_view(victim)["healthy"]

    port = int(victim.rsplit(":", 1)[1])
    fleet.backends[index] = backend(fleet.redis.url, port).wait_listening()
    rejoined = wait_until(
        lambda: (b := fleet.backend_view(victim))["healthy"] and b["synced"] and b["epoch"] != epoch and b,
        "the restarted backend rejoined with a new hello",
    )
    assert rejoined["resyncs"] >= 1
    # what it holds now is known from its new stream: a prompt it alone computed goes back to it
    alone = text_prompt(loaded, 6 * PAGE, seed=31)
    httpx.post(victim + "/v1/completions", json={**body, "prompt": alone, "max_tokens": 2}, timeout=120)
    wait_until(lambda: fleet.backend_view(victim)["pages"]["L1"] >= 5, "its pages are published")
    again = fleet.post("/v1/completions", {**body, "prompt": alone, "max_tokens": 2})
    assert again.headers["x-kvtier-backend"] == victim
    assert again.json()["usage"]["prompt_tokens_details"]["sources"]["L1"] >= 5 * PAGE
