"""Restore bandwidth per link, beside memcpy of the same bytes in the same run.

    python bench/restore_bandwidth.py [--pages 1 16 256] [--rounds 7] [--json]

``kvtier bench restore``'s measurement (``kvtier.costmodel.bandwidth.measure``: every
row the best of the same interleaved rounds) on the default model's KV geometry (24
layers, 2 KV heads, head_dim 64, 128-token pages, float32: 3 MiB a page), without a
model: no prefill samples, no break-even lengths.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
import mlx.core as mx
import numpy as np

from kvtier.costmodel.bandwidth import ROUNDS, Memcpy, measure  # noqa: F401  (Memcpy: bench/redis_restore.py)
from kvtier.engine.blas import blas_in_use
from kvtier.tiers.page import Namespace, PageGeometry, page_keys

GEOMETRY = PageGeometry(24, 2, 64, 128, "float32")
NS = Namespace("bench", "float32", 128)
GIB = 1 << 30


def make_pages(n: int) -> tuple[list[int], list, list[mx.array]]:
    """n pages of random KV in GEOMETRY, their keys and tokens (bench/redis_restore.py)."""
    tokens = list(np.random.default_rng(0).integers(0, 250, n * 128 + 1))
    keys = page_keys(NS, tokens)[:n]
    pages = [mx.random.normal(GEOMETRY.shape, key=mx.random.key(i)) for i in range(n)]
    mx.eval(pages)
    return tokens, keys, pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = measure(GEOMETRY, Path(tmp), tuple(args.pages), args.rounds)
    report["blas"] = blas_in_use()
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"BLAS: {report['blas']}; page = {GEOMETRY.nbytes / (1 << 20):.1f} MiB; "
        f"best of {report['rounds']} interleaved rounds"
    )
    print(f"{'pages':>5} {'restore':>12} {'GiB/s':>7} {'memcpy':>7} {'2thr':>6} {'ratio':>6}")
    for r in report["restores"]:
        print(
            f"{r['pages']:>5} {r['row']:>12} {r['gib_s']:7.2f} {r['memcpy_gib_s']:7.2f} "
            f"{r['memcpy_2_threads_gib_s']:6.2f} {r['ratio_to_memcpy']:6.2f}"
        )
    limits, peer = report["limits"], report["peer"]
    print(
        f"{peer['pages']} pages: LMDB zero-copy read {limits['lmdb_zero_copy_read_gib_s']:.2f} GiB/s, zstd "
        f"decompress {limits['zstd_decompress_gib_s']:.2f}, load_prompt_cache "
        f"{peer['load_prompt_cache_gib_s']:.2f}; its time / ours from L3: {peer['ratio']:.2f}"
    )
    print("ratio: memcpy time (one thread) / restore time, same bytes; 2thr: memcpy split over two threads, GiB/s")


if __name__ == "__main__":
    main()
