"""Load on kvtier serve: N concurrent streaming clients (default 16) for a bounded time.
Each client loops over chat requests that share a system prompt (cached by one request
before the clients start) and differ in their question. Reports errors, TTFT p50 / p95,
generated tokens per second, and the server's resident memory sampled through the run (it
must level off, not grow per request).

    python bench/serve_load.py [--model DIR] [--clients 16] [--seconds 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_common import kvtier_server, percentile, rss_bytes, stream_chat  # noqa: E402
from serve_head_to_head import SYSTEM, TASKS  # noqa: E402


def client_loop(server, stop: threading.Event, seed: int, max_tokens: int, out: dict) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            question = f"{rng.choice(TASKS)} (ticket {rng.randrange(10**6)})"
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            try:
                reply = stream_chat(client, server, messages, max_tokens)
            except httpx.HTTPError as err:
                out["errors"].append(f"{type(err).__name__}: {err}")
                continue
            out["ttft"].append(reply.ttft_s)
            out["tokens"] += reply.tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: kvtier's default model)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8721)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    server = kvtier_server(args.model, args.port, Path(tempfile.mkdtemp(prefix="kvtier-load-"))).start()
    with httpx.Client(timeout=600) as client:  # one request first: the shared system prompt is cached, as
        stream_chat(
            client,
            server,
            [
                {"role": "system", "content": SYSTEM},  # in a server that has been up a while
                {"role": "user", "content": TASKS[0]},
            ],
            1,
        )
    out: dict = {"ttft": [], "tokens": 0, "errors": []}
    stop = threading.Event()
    rss = [(0.0, rss_bytes(server.proc.pid), 0)]
    threads = [
        threading.Thread(target=client_loop, args=(server, stop, i, args.max_tokens, out)) for i in range(args.clients)
    ]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    while (elapsed := time.perf_counter() - t0) < args.seconds:
        time.sleep(1)
        rss.append((elapsed, rss_bytes(server.proc.pid), len(out["ttft"])))
    stop.set()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - t0
    exit_status = server.stop()
    third = len(rss) // 3
    report = {
        "clients": args.clients,
        "seconds": wall,
        "requests": len(out["ttft"]),
        "errors": len(out["errors"]),
        "first_errors": out["errors"][:3],
        "ttft_p50_s": percentile(out["ttft"], 50),
        "ttft_p95_s": percentile(out["ttft"], 95),
        "tokens_per_s": out["tokens"] / wall,
        "rss_mib": {
            "start": rss[0][1] / 2**20,
            "after_first_third": rss[third][1] / 2**20,
            "end": rss[-1][1] / 2**20,
            "peak": max(r for _, r, _ in rss) / 2**20,
        },
        # growth per request over the last two thirds (after warm-up): near 0 if nothing leaks
        "rss_kib_per_request_after_warmup": ((rss[-1][1] - rss[third][1]) / 1024 / max(rss[-1][2] - rss[third][2], 1)),
        "server_exit_status": exit_status,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0 if not out["errors"] and exit_status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
