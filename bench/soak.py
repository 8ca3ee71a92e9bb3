"""Threaded soak of a serving engine: the acceptance run of issue 11, and growth over many requests.

    python bench/soak.py [--rounds 4] [--per-round 500] [--threads 8] [--store DIR]

8 submitter threads; each round, ``per-round`` requests: identical prompts (single
flight) and distinct ones, some cancelled (at once or after their first token), some
failing by injected faults (while admitted, while publishing). Uses the tiny model of
tests/engine/tiny.py (the engine's bookkeeping, not the model, is under test) and the
driver of tests/engine/soak.py. Prints the outcomes, what was left (pins, caps), the
size of every engine structure that changed between rounds (the cached-tokens window
holds the admissions of its last second, so it moves with the rate), and the process's
RSS and mlx's active memory after each round (RSS includes the pages of the LMDB map
read so far, up to the L3 cap).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ is not installed

from kvtier.engine.engine import Engine, EngineConfig  # noqa: E402
from kvtier.tiers.hierarchy import StoreConfig  # noqa: E402
from tests.engine.soak import soak  # noqa: E402
from tests.engine.tiny import tiny_model  # noqa: E402

PAGE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=500)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--store", type=Path, default=None, help="L3 directory (default: a temporary one)")
    args = parser.parse_args()

    loaded = tiny_model()
    page_bytes = loaded.geometry(PAGE).nbytes
    with tempfile.TemporaryDirectory() as scratch:
        store = StoreConfig(
            l1_bytes=64 * page_bytes,
            l2_bytes=64 * page_bytes,
            l3_bytes=256 * page_bytes,
            store_dir=args.store or Path(scratch),
        )
        engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store, max_running=16, window_s=1.0))
        t0 = time.perf_counter()
        report = soak(engine, rounds=args.rounds, per_round=args.per_round, threads=args.threads)
        seconds = time.perf_counter() - t0
        engine.close()
    total = args.rounds * args.per_round
    print(
        json.dumps(
            {
                "requests": total,
                "threads": args.threads,
                "outcomes": {f"{action}->{reason}": n for (action, reason), n in sorted(report.outcomes.items())},
                "ended": sum(report.outcomes.values()),
                "wrong_outputs": report.wrong_outputs,
                "pins_left": report.pins,
                "over_cap": report.over_cap,
                "grown_structures": report.grown,
                "rss_mib_and_mlx_active_mib_per_round": [[round(m, 1) for m in pair] for pair in report.memory],
                "totals": {k: report.totals[k] for k in ("requests", "cancelled", "errors")},
                "requests_per_s": round(total / seconds, 1),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
