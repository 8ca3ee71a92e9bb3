"""Restore bandwidth per link, beside memcpy of the same bytes in the same run.

    python bench/restore_bandwidth.py [--pages 1 16 256] [--json]

For each prefix length it publishes pages of the default model's KV geometry
(24 layers, 2 KV heads, head_dim 64, 128-token pages), places them in one tier,
restores them through ``TieredStore.restore`` (the engine's path) and reports:
- the whole restore (pages joined into one request array) and each link's share;
- memcpy of the same bytes (numpy, warm destination) and the ratio to it;
- for L3, the OS page cache is warm (the pages are read once before timing);
- mlx_lm's ``load_prompt_cache`` of the same KV (safetensors, page cache warm);
- peak extra memory of the restore beyond the request's own KV, in pages.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from engine.blas import blas_in_use
from tiers.hierarchy import StoreConfig, TieredStore
from tiers.page import Namespace, PageGeometry, Source, page_keys

GEOMETRY = PageGeometry(24, 2, 64, 128, "float32")
NS = Namespace("bench", "float32", 128)
GIB = 1 << 30


def make_pages(n: int) -> tuple[list[int], list, list[mx.array]]:
    tokens = list(np.random.default_rng(0).integers(0, 250, n * 128 + 1))
    keys = page_keys(NS, tokens)[:n]
    pages = [mx.random.normal(GEOMETRY.shape, key=mx.random.key(i)) for i in range(n)]
    mx.eval(pages)
    return tokens, keys, pages


def memcpy_seconds(nbytes: int, repeats: int = 3) -> float:
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the destination in: we time the copy, not the kernel
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def store_with(tier: str, n: int, directory: Path) -> TieredStore:
    big = (n + 1) * GEOMETRY.nbytes
    sizes = {"L1": (big, 0), "L2": (0, big), "L3": (0, 0)}[tier]
    return TieredStore(GEOMETRY, NS, StoreConfig(*sizes, l3_bytes=4 * big, store_dir=directory))


def timed_restore(tier: str, n: int, directory: Path, tokens, keys, pages) -> dict:
    """Place n pages in ``tier``, then time the second of two restores (steady state:
    the staging buffer, mlx's buffer cache and, for L3, the OS page cache are warm)."""
    writer = store_with("L1" if tier == "L3" else tier, n, directory)  # L3: written by close()
    for key, i in zip(keys, range(n)):
        writer.publish(key, tokens[i * 128 : (i + 1) * 128], pages[i])
    if tier == "L3":
        writer.close()
    reader = writer if tier == "L2" else store_with("L2", n, directory)
    reader.release(reader.restore(keys, tokens).keys)
    if tier == "L3":  # forget the L2 copies the warm-up made; their slots stay warm
        for key in keys:
            reader.l2.pop(key)
    before = {k: dict(v) for k, v in reader.stats()["links"].items()}
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    restored = reader.restore(keys, tokens)
    seconds = time.perf_counter() - t0
    extra = mx.get_peak_memory() - base - n * GEOMETRY.nbytes  # beyond the request's own KV
    assert restored.num_pages == n and set(restored.sources) == {Source(tier)}, restored.sources
    links = {}
    for name, after in reader.stats()["links"].items():
        if after["pages"] > before[name]["pages"] and name in ("L3->L2", "L2->L1"):
            links[name] = {k: after[k] - before[name][k] for k in ("bytes", "pages", "seconds")}
    reader.release(restored.keys)
    reader.close()
    return {"seconds": seconds, "links": links, "extra_pages": extra / GEOMETRY.nbytes,
            "staging_pages": GEOMETRY.nbytes * n / GEOMETRY.num_layers / GEOMETRY.nbytes}


def load_prompt_cache_seconds(pages: list[mx.array], directory: Path) -> float:
    kv = mx.concatenate(pages, axis=3)
    cache = []
    for layer in range(GEOMETRY.num_layers):
        c = KVCache()
        c.state = (kv[layer, 0][None], kv[layer, 1][None], kv.shape[3])
        cache.append(c)
    path = str(directory / "prompt.safetensors")
    save_prompt_cache(path, cache)
    load_prompt_cache(path)  # page cache warm
    t0 = time.perf_counter()
    loaded = load_prompt_cache(path)
    mx.eval([c.state[:2] for c in loaded])
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    mx.set_cache_limit(4 * GIB)
    rows = []
    for n in args.pages:
        tokens, keys, pages = make_pages(n)
        nbytes = n * GEOMETRY.nbytes
        memcpy = memcpy_seconds(nbytes)
        for tier in ("L2", "L3"):
            with tempfile.TemporaryDirectory() as tmp:
                result = timed_restore(tier, n, Path(tmp), tokens, keys, pages)
            rows.append({"pages": n, "bytes": nbytes, "from": tier, **result,
                         "gib_s": nbytes / result["seconds"] / GIB, "memcpy_gib_s": nbytes / memcpy / GIB,
                         "ratio_to_memcpy": memcpy / result["seconds"]})
        with tempfile.TemporaryDirectory() as tmp:
            peer = load_prompt_cache_seconds(pages, Path(tmp))
        l3 = rows[-1]
        rows.append({"pages": n, "bytes": nbytes, "from": "load_prompt_cache", "seconds": peer,
                     "gib_s": nbytes / peer / GIB, "ratio_ours_l3_vs_peer": peer / l3["seconds"]})
    if args.json:
        print(json.dumps({"blas": blas_in_use(), "rows": rows}, indent=1))
        return
    print(f"BLAS: {blas_in_use()}; page = {GEOMETRY.nbytes / (1 << 20):.1f} MiB")
    print(f"{'pages':>5} {'from':>17} {'GiB/s':>7} {'memcpy':>7} {'ratio':>6} {'extra pages':>11}  per link GiB/s")
    for r in rows:
        links = "  ".join(f"{k} {v['bytes'] / v['seconds'] / GIB:.2f}" for k, v in r.get("links", {}).items())
        ratio = r.get("ratio_to_memcpy", r.get("ratio_ours_l3_vs_peer"))
        memcpy_rate = f"{r['memcpy_gib_s']:7.2f}" if "memcpy_gib_s" in r else " " * 7
        extra = f"{r['extra_pages']:11.2f}" if "extra_pages" in r else " " * 11
        print(f"{r['pages']:>5} {r['from']:>17} {r['gib_s']:7.2f} {memcpy_rate} {ratio:6.2f} {extra}  {links}")
    print("ratio: restore vs memcpy of the same bytes; for load_prompt_cache: its time / ours from L3")


if __name__ == "__main__":
    main()
