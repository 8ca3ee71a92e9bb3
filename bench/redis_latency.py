"""A restored request through a slow network to Redis, against recomputing it.

    python bench/redis_latency.py [--model kvtier-tiny] [--pages 4 16] [--delays 0 0.05] [--page-size 16]

Starts its own redis-server and, for each delay, a TCP proxy adding that delay to each
request (``tests.redis_servers.SlowProxy``, which counts round trips). One engine
computes each prompt into Redis directly; a second (its own L1 and L2: another host)
runs it through the proxy. Reported per prompt and delay: the request's seconds from
submit to its end, the round trips it made, its tokens restored from L3, and the
seconds of recomputing it (an engine without a store), best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' server helpers
from kvtier.engine.engine import Engine, EngineConfig  # noqa: E402
from kvtier.engine.models.load import load_model  # noqa: E402
from kvtier.engine.request import SamplingParams  # noqa: E402
from kvtier.tiers.hierarchy import StoreConfig  # noqa: E402
from tests.redis_servers import RedisServer, SlowProxy  # noqa: E402

PARAMS = SamplingParams(max_tokens=4)


def timed(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submit to end of one request, and its tokens restored from L3."""
    (request,) = engine.generate([prompt], PARAMS)
    assert request.t_done is not None
    return request.t_done - request.t_submit, request.sources()["L3"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kvtier-tiny")
    parser.add_argument("--pages", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.05])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    loaded = load_model(args.model)
    size = args.page_size
    print("pages delay_s request_s round_trips l3_tokens recompute_s")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as directory:
        server = RedisServer(Path(directory), "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru")
        try:
            for pages in args.pages:
                recompute = Engine(loaded, EngineConfig(page_size=size, offload=False))
                for delay in args.delays:
                    best = None
                    for r in range(args.rounds):
                        salt = 13 * r + int(delay * 1000) + pages  # a prompt of its own per run
                        prompt = [(7 * i + salt) % 200 + 3 for i in range(pages * size + 1)]
                        seconds_cold, _ = timed(recompute, prompt)
                        first = Engine(loaded, EngineConfig(page_size=size, store=StoreConfig(store_dir=server.url)))
                        first.generate([prompt], PARAMS)
                        first.close()
                        proxy = SlowProxy(server.port, delay)
                        engine = Engine(loaded, EngineConfig(page_size=size, store=StoreConfig(store_dir=proxy.url)))
                        before = proxy.round_trips
                        seconds, l3 = timed(engine, prompt)
                        trips = proxy.round_trips - before
                        engine.close()
                        proxy.close()
                        row = (seconds, trips, l3, seconds_cold)
                        best = row if best is None or row[0] < best[0] else best
                    assert best is not None
                    print(f"{pages:5d} {delay:7.3f} {best[0]:9.4f} {best[1]:11d} {best[2]:9d} {best[3]:11.4f}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
