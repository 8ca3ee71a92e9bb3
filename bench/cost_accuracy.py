"""Cost-model accuracy (issue 4): prediction error after calibration, and decision regret.

    python bench/cost_accuracy.py [--lengths 64 128 256 512 1024 2048 4096] [--repeats 3]
                                  [--throttle auto|none|RATE|L2=RATE|L3=RATE ...]
                                  [--pages 1 2 4 8 16 32 64] [--prefill N:P ...]
                                  [--page-size 128] [--codec raw] [--parts 1 2] [--json]

Everything runs on the embedded default model (float32, 24 layers; a page of 128
tokens is 3 MiB of KV) in temporary stores beside the kvtier home (same filesystem
as the real store), removed at the end. Calibration comes first, in the state a
fresh process is in (as ``kvtier calibrate`` runs): ``costmodel.calibrate.calibrate``
into a temporary store dir. That calibrated profile is the one every prediction and
every planner decision below uses.

1. Prediction error after calibration (target: median <= 20% for restores >= 1 MiB).
   - Restores: pages of the model's geometry are published into a ``TieredStore``
     (L1 off), then restores of ``--pages`` pages are timed from L2 and, after a flush
     and dropping L2's copies, from L3 (OS page cache warm; one untimed warm-up
     restore per size), ``--repeats`` times each, in the mlx state an ``Engine``
     leaves (buffer-cache limit raised). For each restore, every link whose counter
     moved (``store.stats().links`` before/after) gives one sample: predicted =
     the calibrated ``Profile.links[link].predict(bytes that crossed it)``, measured =
     the seconds the counter added. Links the profile has no model for are listed as
     such. An "Lx restore (wall)" row compares the planner's
     ``costmodel.plan.restore_seconds`` for the restored pages with the wall-clock
     time of ``restore`` plus evaluating the KV arrays.
   - Prefill: the model's forward over ``n`` new tokens after ``p`` cached
     (``--prefill N:P``), in chunks of the engine's ``prefill_step_size``, best of
     ``--repeats``, against ``ComputeModel.predict(n, p)``; and, from part 2, each
     prompt's full-recompute time to first token through the engine against
     ``predict(n, 0)`` (that one also holds admission, sampling and publication).
   Reported: median and p90 of |predicted - measured| / measured, per link and for
   compute, every repeat one sample.

2. Decision regret against an oracle that times both choices (target: <= 10%).
   For each prompt length (distinct random byte tokens per length, so no pages are
   shared across cases), the prompt's reusable prefix is stored in L2 (engine with
   L1 off) and, separately, only in L3 (after a flush, L2's copies dropped before
   every run), each without a throttle and with a read throttle on that tier
   (``StoreConfig.throttle``; ``auto`` picks the rate at which restoring the
   2048-token prompt's prefix is predicted to save as much as it costs, so restore
   loses below about 2048 tokens and wins above). Time to first token (submit to
   first token, ``max_tokens=1``) is measured for
     (a) forced restore of every matched page: ``Engine.profile`` set to a profile
         with free links and absurdly slow compute;
     (b) forced recompute of everything: links with an absurd setup time (timed
         once per length and reused across tiers and throttles, since it never
         touches the store);
     (c) the plan the engine picks with the calibrated profile (a fresh copy per run,
         so online refinement in one run does not steer the next).
   The recompute timings' first run also publishes the prompt's pages (L1 off: they
   land in L2), an extra page copy each, small next to prefilling a page.
   (c) runs first, once; if it restored exactly what (a) restores (same per-source
   token counts) that run counts as one of (a)'s repeats and t_c = t_a; if it
   recomputed everything it counts as a recompute sample and t_c = t_b; otherwise
   (c) is timed ``--repeats`` times itself. Each time is the best of ``--repeats``.
   Regret = (t_c - min(t_a, t_b)) / min(t_a, t_b); below 0 when (c) beat both (a
   partial or overlapped plan: compute the first pages while the rest load), which
   the two forced plans cannot show as a loss. Lengths with no full page to reuse
   (n - 1 < page size) are shown but left out of the summary (nothing to decide).
   The throttled-L2 case runs on a second store whose L2 gets the prefixes by
   ``publish`` of pages restored from the first (no second prefill).

The machine is noisy (2 cores, other work may run): only ratios from one run mean
anything; the load average at start and end is printed. Progress goes to stderr.
The default run takes minutes: most of it is the recompute timings (3 x 4096 tokens)
and the throttled restores; the wall time of each phase is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
from kvtier.costmodel.calibrate import calibrate
from kvtier.engine.blas import blas_in_use
from kvtier.engine.engine import EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.engine.models.paths import kvtier_home

sys.path.insert(0, str(Path(__file__).parent))
from cost_accuracy_regret import Bench, throttles_from  # noqa: E402
from cost_accuracy_report import compute_report, print_tables, regret_report, restore_report  # noqa: E402
from cost_accuracy_samples import STARTED, prefill_samples, progress, restore_samples  # noqa: E402

LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)
PAGE_COUNTS = (1, 2, 4, 8, 16, 32, 64)
PREFILL = ((64, 0), (256, 0), (512, 0), (128, 1024), (512, 1024))


def parse_pair(text: str) -> tuple[int, int]:
    n, _, p = text.partition(":")
    if not (n.isdigit() and p.isdigit() and int(n) > 0):
        raise argparse.ArgumentTypeError(f"bad prefill pair {text!r} (use N:P, e.g. 256:1024)")
    return int(n), int(p)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per measurement (best is kept)")
    parser.add_argument(
        "--throttle",
        action="append",
        default=[],
        metavar="auto|none|RATE|TIER=RATE",
        help="read throttle for the throttled cases (default auto, both tiers)",
    )
    parser.add_argument("--pages", type=int, nargs="+", default=list(PAGE_COUNTS), help="restore sizes (pages)")
    parser.add_argument("--prefill", type=parse_pair, nargs="+", default=list(PREFILL), metavar="N:P")
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--codec", default="raw", help="L3 codec of the stores (raw, zstd)")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args(argv)

    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    phases: dict[str, float] = {}
    mark = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = now - mark
        mark = now

    loaded = load_model()
    geometry = loaded.geometry(args.page_size)
    home = kvtier_home()
    home.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    with tempfile.TemporaryDirectory(dir=home, prefix="bench-cost-accuracy-") as tmp:
        root = Path(tmp)
        progress("calibrating")
        profile = calibrate(loaded.model, geometry, root / "calibration")
        report["calibration"] = profile.summary().to_json()
        sizes = {name: len({x[0] for x in link.samples if x[0] > 0}) for name, link in profile.links.items()}
        phase("calibration")
        if 1 in args.parts:
            rows = restore_samples(
                geometry, profile, root / "restore", sorted(set(args.pages)), args.repeats, args.codec
            )
            report["restore"] = {"rows": rows, "summary": restore_report(rows)}
            phase("restores")
            step = EngineConfig().prefill_step_size
            report["prefill"] = prefill_samples(loaded.model, profile, args.prefill, args.repeats, step)
            phase("prefill")
        bench = None
        if 2 in args.parts:
            throttles = throttles_from(args.throttle, profile, geometry)
            report["throttles"] = throttles
            bench = Bench(loaded, profile, args.page_size, root, sorted(set(args.lengths)), args.repeats, args.codec)
            bench.all_cases(throttles)
            report["regret"] = {"cases": bench.cases, "summary": regret_report(bench.cases)}
            report["recompute_ttft"] = {n: (profile.compute.predict(n, 0), min(s)) for n, s in bench.recompute.items()}
            phase("regret")
        if "prefill" in report or bench is not None:
            recompute = bench.recompute if bench is not None else {}
            report["compute_error"] = compute_report(report.get("prefill", []), recompute, profile.compute)
            if "prefill" not in report:
                report["prefill"] = []
    report["meta"] = {
        "model": loaded.name,
        "page_size": args.page_size,
        "page_bytes": geometry.nbytes,
        "codec": args.codec,
        "repeats": args.repeats,
        "blas": blas_in_use(),
        "loadavg_start": loadavg_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": time.perf_counter() - STARTED,
        "phases_s": phases,
        "argv": sys.argv[1:],
        "calibration_sizes": sizes,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_tables(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
