"""L3 on Redis beside LMDB and memcpy: same bytes, same run.

    python bench/redis_restore.py [--pages 1 16 64] [--rounds 5] [--no-cluster] [--no-engine] [--json]

Starts its own redis-server (and a 3-node Redis Cluster) on free loopback ports, then:

1. Restore bandwidth: for each prefix length, pages of the default model's KV geometry
   (float32, 3 MiB a page) are written to an LMDB store, a standalone Redis and the
   cluster; a fresh ``TieredStore`` (empty L1 and L2) restores them, best of the rounds.
   Reported: GiB/s of the raw page bytes and the ratio to one-thread memcpy of the same
   bytes in the same run.
2. TTFT from Redis vs recompute, for the default model: one engine computes a prompt
   into Redis, a second engine (another "host": its own L1 and L2) restores it.
3. Four concurrent ``kvtier run`` processes (four KVTIER_HOMEs) on one Redis, the same
   prompt, computed before by a fifth: how many restored it from L3, and the wall time
   over one such run alone (processes start, load the model and restore at once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' server helpers
from restore_bandwidth import GEOMETRY, NS, Memcpy, make_pages  # noqa: E402

from kvtier.tiers.hierarchy import StoreConfig, TieredStore  # noqa: E402
from kvtier.tiers.page import Source  # noqa: E402

GIB = 1 << 30


def _servers():
    from tests.redis_servers import RedisCluster, RedisServer

    return RedisServer, RedisCluster


def fill(store_dir, n: int) -> tuple[list[int], list]:
    tokens, keys, pages = make_pages(n)
    store = TieredStore(GEOMETRY, NS, StoreConfig(0, 0, None, store_dir))
    for i, key in enumerate(keys):
        store.publish(key, tokens[i * 128 : (i + 1) * 128], pages[i])
    store.close()
    return tokens, keys


def best_restore(store_dir, keys: list, tokens: list[int], rounds: int) -> float:
    """Best seconds of a restore of ``keys`` by a store with empty L1 and L2."""
    import mlx.core as mx

    store = TieredStore(GEOMETRY, NS, StoreConfig(0, (len(keys) + 1) * GEOMETRY.nbytes, None, store_dir))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        restored = store.restore(keys, tokens)
        mx.eval([a for layer in restored.layers for a in layer])
        seconds = time.perf_counter() - t0
        assert restored.sources == [Source.L3] * len(keys), restored.sources
        store.release(restored.keys)
        best = min(best, seconds)
    store.close()
    return best


def bandwidth(page_counts: list[int], rounds: int, cluster: bool) -> list[dict]:
    RedisServer, RedisCluster = _servers()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "redis").mkdir()
        (tmp / "cluster").mkdir()
        servers = {"redis": RedisServer(tmp / "redis", "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru")}
        if cluster:
            servers["cluster"] = RedisCluster(
                tmp / "cluster", "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"
            )
        try:
            for n in page_counts:
                nbytes = n * GEOMETRY.nbytes
                memcpy = Memcpy(nbytes)
                copy_s = min(timeit.timeit(memcpy.one_thread, number=1) for _ in range(rounds))
                row = {"pages": n, "mib": nbytes / (1 << 20), "memcpy_gib_s": nbytes / copy_s / GIB}
                backends = {"lmdb": tmp / f"lmdb-{n}", **{name: s.url for name, s in servers.items()}}
                for name, store_dir in backends.items():
                    tokens, keys = fill(store_dir, n)
                    seconds = best_restore(store_dir, keys, tokens, rounds)
                    row[f"{name}_gib_s"] = nbytes / seconds / GIB
                    row[f"{name}_vs_memcpy"] = copy_s / seconds
                for s in servers.values():
                    for node in getattr(s, "nodes", [s]):
                        node.client().flushall()
                rows.append(row)
        finally:
            for s in servers.values():
                s.stop()
    return rows


PROMPT = " ".join(["the system prompt of an agent with tools, a long history and many rules"] * 24)


def ttft(url: str) -> dict:
    """TTFT of a prompt recomputed vs restored from Redis by a second engine."""
    from kvtier.engine.engine import Engine, EngineConfig
    from kvtier.engine.models.load import load_model
    from kvtier.engine.request import SamplingParams

    loaded = load_model()
    prompt = loaded.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=4)

    def engine() -> Engine:
        return Engine(loaded, EngineConfig(store=StoreConfig(1 << 30, 1 << 30, None, url)))

    warmup = Engine(loaded, EngineConfig(offload=False))
    warmup.generate([prompt[:64]], params)
    warmup.close()
    first = engine()
    (cold,) = first.generate([prompt], params)
    first.close()  # flushes its pages to Redis
    second = engine()
    (warm,) = second.generate([prompt], params)
    second.close()
    assert warm.output == cold.output
    return {
        "prompt_tokens": len(prompt),
        "restored_tokens": warm.sources().get("L3", 0),
        "recompute_ttft_s": cold.t_first_token - cold.t_submit,
        "redis_ttft_s": warm.t_first_token - warm.t_submit,
        "speedup": (cold.t_first_token - cold.t_submit) / (warm.t_first_token - warm.t_submit),
    }


def concurrent_runs(url: str, processes: int = 4) -> dict:
    """``processes`` kvtier runs at once on one Redis (each its own home), restoring what a
    first run computed; wall time over one such run alone."""

    def launch(home: Path) -> subprocess.Popen:
        env = {**os.environ, "KVTIER_HOME": str(home), "KVTIER_NO_AUTO_CALIBRATE": "1"}
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtier.engine.cli",
                "run",
                "--json",
                "--max-tokens",
                "4",
                "--store",
                url,
                "--prompt",
                PROMPT,
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    with tempfile.TemporaryDirectory() as tmp:
        launch(Path(tmp) / "first").communicate()  # computes the prompt into Redis
        t0 = time.perf_counter()
        launch(Path(tmp) / "alone").communicate()  # restores it, alone
        alone_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        runs = [launch(Path(tmp) / str(i)) for i in range(processes)]
        results = [json.loads(r.communicate()[0].splitlines()[0]) for r in runs]
        together_s = time.perf_counter() - t0
    return {
        "processes": processes,
        "restored_from_l3": sum(r["sources"].get("L3", 0) > 0 for r in results),
        "same_output": len({tuple(r["output_token_ids"]) for r in results}) == 1,
        "wall_over_one_alone": together_s / alone_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-cluster", action="store_true")
    parser.add_argument("--no-engine", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = {"bandwidth": bandwidth(args.pages, args.rounds, not args.no_cluster)}
    if not args.no_engine:
        RedisServer, _ = _servers()
        with tempfile.TemporaryDirectory() as tmp:
            server = RedisServer(Path(tmp), "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru")
            try:
                report["ttft"] = ttft(server.url)
                server.client().flushall()
                report["concurrent"] = concurrent_runs(server.url)
            finally:
                server.stop()
    if args.json:
        print(json.dumps(report))
        return
    for row in report["bandwidth"]:
        cells = [f"{row['pages']:>3} pages ({row['mib']:.0f} MiB): memcpy {row['memcpy_gib_s']:.2f} GiB/s"]
        cells += [
            f"{name} {row[f'{name}_gib_s']:.2f} GiB/s ({row[f'{name}_vs_memcpy']:.2f}x memcpy)"
            for name in ("lmdb", "redis", "cluster")
            if f"{name}_gib_s" in row
        ]
        print("; ".join(cells))
    if "ttft" in report:
        t = report["ttft"]
        print(
            f"TTFT, {t['prompt_tokens']} tokens ({t['restored_tokens']} from Redis): "
            f"restored {t['speedup']:.1f}x faster than recomputed"
        )
        c = report["concurrent"]
        print(
            f"{c['processes']} concurrent runs: {c['restored_from_l3']} restored from L3, same output: "
            f"{c['same_output']}, wall time {c['wall_over_one_alone']:.2f}x one alone"
        )


if __name__ == "__main__":
    main()
