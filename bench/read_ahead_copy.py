"""What an LMDB read ahead costs its reader thread now that it copies each record out of
the map (``tiers.l3.lmdb_store._LmdbSnapshot._owned``: the step loop never faults on the
disk), against the floor of touching every byte through the map once
(``L3Store.read_through``: a hash, no copy).

    python bench/read_ahead_copy.py [--pages 64] [--page-bytes 368640] [--rounds 15]

The store is a fresh one in a temporary directory, its records in the page cache (a
warm disk): the figures are the copy's, not the disk's. Median of ``--rounds``.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)
from kvtier.tiers.l3.lmdb_store import DiskTier

NS, TOKENS = b"N" * 16, list(range(16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-bytes", type=int, default=368_640)  # SmolLM2-135M, 16 tokens, bf16
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    keys = [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(args.pages)]
    with tempfile.TemporaryDirectory() as directory:
        tier = DiskTier(Path(directory), 1 << 34)
        rng = np.random.default_rng(0)
        for key in keys:
            tier.put(key, NS, TOKENS, rng.integers(0, 255, args.page_bytes, np.uint8).tobytes(), wait=True)
        tier.flush()
        ahead, through = [], []
        for _ in range(args.rounds):
            with tier.snapshot() as snapshot:
                t0 = time.perf_counter()
                snapshot.read_ahead(keys, args.page_bytes)
                ahead.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tier.read_through(keys)
            through.append(time.perf_counter() - t0)
        tier.close()
    total = args.pages * args.page_bytes
    for name, times in (("read ahead (copies)", ahead), ("read through (hash)", through)):
        seconds = statistics.median(times)
        rate = total / seconds / 1e9
        print(f"{name}: {args.pages} records of {args.page_bytes} B in {seconds * 1e3:.1f} ms ({rate:.2f} GB/s)")


if __name__ == "__main__":
    main()
