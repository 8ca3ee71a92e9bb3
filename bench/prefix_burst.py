"""A burst of prompts sharing a long prefix (an agent fleet's system prompt): who computes it.

    python bench/prefix_burst.py [--sizes 2 4 8] [--prefix 3000] [--suffix 50] [--max-tokens 16]

A cold store (L1 and L2 only); N prompts arrive together, each the same ``--prefix``
tokens followed by ``--suffix`` tokens of its own. For each single-flight policy
(off, after-prefill, prefix): prompt tokens computed (the ``recomputed`` labels),
mean and p95 time to first token, total time. The control sends N prompts with
nothing in common under ``off`` and ``prefix`` (prefix flight must cost nothing
there). Every engine starts from one quick calibration of this machine (as
``kvtier run`` does on first use), so the wait-or-compute decisions are priced on
measured prefill times. Ratios to ``off`` are printed beside the times.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)
from kvtier.costmodel.calibrate import calibrate
from kvtier.costmodel.profile import Profile
from kvtier.engine.blas import blas_in_use
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

POLICIES = ("off", "after-prefill", "prefix")


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + j * 31) % 90 + 32 for j in range(n)]


def run_burst(loaded, profile: Profile, policy: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine = Engine(loaded, EngineConfig(store=StoreConfig(store_dir=None), single_flight=policy))
    engine.profile = Profile.from_dict(profile.to_dict())
    t0 = time.perf_counter()
    requests = engine.generate(prompts, params)
    total = time.perf_counter() - t0
    engine.close()
    ttft = sorted(r.t_first_token - r.t_submit for r in requests)
    return {
        "computed": sum(r.sources()["recomputed"] for r in requests),
        "mean_ttft": statistics.mean(ttft),
        "p95_ttft": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))],
        "total": total,
        "waited": sum(r.waited_tokens for r in requests),
    }


def show(title: str, rows: dict[str, dict], ideal: int | None) -> None:
    print(title)
    print(
        f"  {'policy':>14} {'computed':>9} {'/ideal':>7} {'waited':>7} {'mean TTFT s':>12} {'x off':>6} "
        f"{'p95 TTFT s':>11} {'total s':>8} {'x off':>6}"
    )
    off = rows["off"]
    for policy, r in rows.items():
        ratio = f"{r['computed'] / ideal:7.2f}" if ideal else f"{'-':>7}"
        print(
            f"  {policy:>14} {r['computed']:>9} {ratio} {r['waited']:>7} {r['mean_ttft']:>12.2f} "
            f"{r['mean_ttft'] / off['mean_ttft']:>6.2f} {r['p95_ttft']:>11.2f} {r['total']:>8.2f} "
            f"{r['total'] / off['total']:>6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--prefix", type=int, default=3000)
    parser.add_argument("--suffix", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    loaded = load_model()
    params = SamplingParams(max_tokens=args.max_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        profile = calibrate(loaded.model, loaded.geometry(EngineConfig().page_size), Path(scratch), quick=True)
    print(
        f"model {loaded.name}, BLAS {blas_in_use()}, prefix {args.prefix} + suffix {args.suffix} tokens, "
        f"{args.max_tokens} output tokens each; prefill model c0, c1, c2 = {profile.compute.coef}"
    )
    shared = tokens(args.prefix, 0)
    for n in args.sizes:
        prompts = [shared + tokens(args.suffix, 1 + i) for i in range(n)]
        rows = {policy: run_burst(loaded, profile, policy, prompts, params) for policy in POLICIES}
        show(f"burst of {n} sharing the prefix (ideal: prefix + {n} x suffix)", rows, args.prefix + n * args.suffix)
    n = max(args.sizes)
    distinct = [tokens(args.prefix + args.suffix, 100 + i) for i in range(n)]
    rows = {policy: run_burst(loaded, profile, policy, distinct, params) for policy in ("off", "prefix")}
    show(f"control: {n} prompts with nothing in common", rows, None)


if __name__ == "__main__":
    main()
