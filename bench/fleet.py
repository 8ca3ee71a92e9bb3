"""A fleet on this machine: three ``kvtier serve`` backends sharing one ``redis-server``
as L3, ``kvtier route`` in front, and an agent-like workload through it, once per
policy (cache-aware, round-robin, least-load), each on fresh backends and an empty L3
(a key prefix of its own); ``single`` is one backend alone, for its cached fraction.

The workload, an agent's: ``--conversations`` conversations (24), half on each of two
system prompts (``--system-words`` words each), ``--turns`` turns each, and every turn
after the first brings back the output of the tool the previous answer ran
(``--tool-words`` words) before the next ask (``--ask-words`` words), so a history grows
by a tool output, an ask and an answer a turn, as a coding agent's does: a long system
prompt, tool outputs much longer than the asks, the answer appended before the next
turn. The defaults keep those proportions at a size this 2-core machine prefills in
minutes (the tokenizer of ``kvtier-tiny`` is byte-level: a word is about 6 tokens).
``--concurrency`` conversations run at a time, each turn streamed (``--max-tokens``).
Per policy: TTFT p50 and p95 (the first chunk with text), prompt tokens computed
(``recomputed`` in the usage) and their share, and each backend's requests; ``--json``
adds where the prompt tokens came from (the usage's ``sources`` summed), where the mean
TTFT goes (the client's, the backends' own from their ``/metrics``, of it their
admission wait) and the router's placements by reason. The backends run without the
first-use calibration (the profile defaults, the same for every policy) so runs differ
only by placement. Each backend keeps OpenBLAS's own thread count (one per core): three
backends busy at once on two cores ran as fast as with one thread each, and a backend
busy alone, as cache-aware placement often leaves one, prefills faster with both.

The backends write the shared L3 through (``serve --l3-write-through``, DESIGN §2): each
page a backend publishes is queued for L3 at once, so a turn sent away from its
conversation's backend restores that history from L3 (``sources`` L3) instead of
recomputing it. ``--write-back`` runs them without it, as a single engine runs: L3 then
gets a page only when a backend spills it, and while every backend's L1 has room a turn
sent away recomputes the history that backend holds.

On one machine the backends also share its cores, so a prefill is slower while the
others compute: the backends' admission wait is the queue the router prices, the rest
of their TTFT is restore, prefill and that sharing. On a machine of few cores that rest
is nearly all prefill (``kvtier-tiny`` is 24 float32 layers on mlx's CPU backend, and
its attention's cost grows with the context), so TTFTs of seconds are the prefill:
what cache-aware placement saves, and what a turn sent away from its history pays.

    python bench/fleet.py [--model M] [--policies cache-aware,round-robin,least-load,single]
                          [--conversations 24] [--turns 5] [--system-words 150] [--ask-words 8]
                          [--tool-words 30] [--concurrency 3] [--max-tokens 8] [--page-size 32]
                          [--write-back] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx
from serve_common import Server, percentile, stream_chat

BACKENDS = 3
POLICIES = ("cache-aware", "round-robin", "least-load", "single")
WORDS = "cache page tier restore token prefix model host disk link queue engine router fleet batch".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return f"You are agent {seed}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(index: int, systems: list[str], turns: int, ask_words: int, tool_words: int) -> list[list[dict]]:
    """The messages of each turn but the answers (filled in as they come). As an agent's:
    every turn after the first also brings back the output of the tool the previous answer
    ran (``tool_words`` words), so the history grows by a tool output and an ask a turn."""
    rng = random.Random(1000 + index)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    asks = [
        (f"Tool output {index}.{t - 1}:\n{words(tool_words)}\n" if t and tool_words else "")
        + f"Task {index}.{t}: {words(ask_words)}"
        for t in range(turns)
    ]
    return [
        [{"role": "system", "content": systems[index % len(systems)]}],
        *([{"role": "user", "content": a}] for a in asks),
    ]


def latency_sums(url: str) -> Counter:
    """A backend's Prometheus sums and counts of its TTFT (submission to first token) and
    queue (submission to admission into the batch)."""
    sums: Counter = Counter()
    for line in httpx.get(url + "/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(("kvtier_ttft_seconds_", "kvtier_queue_seconds_")) and name.endswith(("_sum", "_count")):
            sums[name] += float(value)
    return sums


def kvtier(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.engine.cli", *args]


def run_policy(policy: str, args, redis_url: str) -> dict:
    n = 1 if policy == "single" else BACKENDS
    store = f"{redis_url}?prefix=fleet-{policy}-{os.getpid()}:"
    model = ["--model", args.model] if args.model else []
    backends = []
    for i in range(n):
        port = free_port()
        flags = ["--store", store, "--page-size", str(args.page_size), "--no-auto-calibrate", *model]
        flags += [] if args.write_back else ["--l3-write-through"]
        cmd = kvtier("serve", "--port", str(port), *flags)
        backends.append(Server(f"backend-{i}", cmd, f"http://127.0.0.1:{port}", None).start())
    front = backends[0]
    router = None
    if policy != "single":
        port = free_port()
        flags = [f for b in backends for f in ("--backend", b.url)]
        cmd = kvtier("route", "--port", str(port), "--policy", policy, "--l3-redis", store, *flags, *model)
        router = front = Server("router", cmd, f"http://127.0.0.1:{port}", None).start()
        deadline = time.monotonic() + 60
        while not all(b["synced"] for b in httpx.get(router.url + "/v1/kvtier/route").json()["backends"]):
            assert time.monotonic() < deadline, "the router did not sync"
            time.sleep(0.2)
    systems = [system_prompt(s, args.system_words) for s in range(2)]
    replies = []

    def converse(index: int) -> list:
        messages, out = [], []
        with httpx.Client(timeout=600) as client:
            for part in conversation(index, systems, args.turns, args.ask_words, args.tool_words):
                messages += part
                if part[0]["role"] == "system":
                    continue
                reply = stream_chat(client, front, messages, args.max_tokens)
                messages.append({"role": "assistant", "content": reply.text})
                out.append(reply)
        return out

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for done in pool.map(converse, range(args.conversations)):
            replies += done
    wall = time.perf_counter() - t0
    reasons = httpx.get(router.url + "/v1/kvtier/route").json()["reasons"] if router else {}
    sums = sum((latency_sums(b.url) for b in backends), Counter())
    for server in [*([router] if router else []), *backends]:
        server.stop()
    ttfts = [r.ttft_s for r in replies]
    prompt = sum(r.usage.get("prompt_tokens", 0) for r in replies)
    sources = Counter()
    for r in replies:
        sources.update(r.usage["prompt_tokens_details"]["sources"])
    computed = sources["recomputed"]
    return {
        "policy": policy,
        "l3_write_through": not args.write_back,
        "requests": len(replies),
        "wall_s": round(wall, 1),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p95_s": round(percentile(ttfts, 95), 3),
        "prompt_tokens": prompt,
        "computed_tokens": computed,
        "cached_fraction": round(1 - computed / prompt, 3) if prompt else 0.0,
        "sources": dict(sources),
        # where a request's TTFT goes, averaged over requests: the client's (through the
        # router), of it the backends' own (submission to first token; the difference is
        # the router and the hops), of that the wait for admission into the batch (the
        # rest: restore and prefill, and decoding beside the batch's other requests)
        "ttft_mean_s": round(sum(ttfts) / max(len(ttfts), 1), 3),
        "backend_ttft_mean_s": round(sums["kvtier_ttft_seconds_sum"] / max(sums["kvtier_ttft_seconds_count"], 1), 3),
        "backend_queue_mean_s": round(sums["kvtier_queue_seconds_sum"] / max(sums["kvtier_queue_seconds_count"], 1), 3),
        "per_backend": dict(sorted(Counter(r.backend or backends[0].url for r in replies).items())),
        "reasons": reasons,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="the backends' model (default: kvtier's default)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-words", type=int, default=150)
    parser.add_argument("--ask-words", type=int, default=8)
    parser.add_argument("--tool-words", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--write-back", action="store_true", help="backends without --l3-write-through")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    policies = args.policies.split(",")
    if unknown := set(policies) - set(POLICIES):
        parser.error(f"unknown policies {sorted(unknown)}")
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        parser.error("redis-server is not installed")
    with tempfile.TemporaryDirectory() as directory:
        port = free_port()
        redis = subprocess.Popen(
            [
                redis_server,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                directory,
                "--maxmemory",
                "1gb",
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)
            results = [run_policy(p, args, f"redis://127.0.0.1:{port}") for p in policies]
        finally:
            redis.kill()
            redis.wait()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'policy':<12} {'reqs':>5} {'p50 s':>7} {'p95 s':>7} {'computed':>9} {'cached':>7}  per backend")
    for r in results:
        spread = " ".join(str(v) for v in r["per_backend"].values())
        print(
            f"{r['policy']:<12} {r['requests']:>5} {r['ttft_p50_s']:>7.3f} {r['ttft_p95_s']:>7.3f} "
            f"{r['computed_tokens']:>9} {r['cached_fraction']:>7.1%}  {spread}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
