"""Identical cold arrivals (after the first article in shared/seeds): who computes, who waits.

    python bench/single_flight.py [--sizes 2 4 8] [--tokens 500] [--max-tokens 128]

A cold store; N identical prompts of about 500 tokens arrive together, 128 output
tokens each. For each mode: prompt tokens computed, reused tokens per follower,
mean TTFT and the slowest completion. Modes:
- completion-publish: no coordination, pages published only when a request ends;
- incremental: no coordination, pages published after every step;
- sf-at-completion / sf-after-prefill: single flight, followers released when the
  leader finishes / when it has published its prompt pages.
A control with distinct prompts checks single flight costs nothing there, and a
second case sends the second request just after the first enters decode.
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, when installed)
from kvtier.engine.blas import blas_in_use
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

MODES = {
    "completion-publish": {"single_flight": "off", "publish": "at-completion"},
    "incremental": {"single_flight": "off", "publish": "incremental"},
    "sf-at-completion": {"single_flight": "at-completion"},
    "sf-after-prefill": {"single_flight": "after-prefill"},
}


def prompt(tokens: int, seed: int) -> list[int]:
    return [(seed * 7919 + j * 31) % 90 + 32 for j in range(tokens)]


def engine_for(loaded, mode: str) -> Engine:
    return Engine(loaded, EngineConfig(store=StoreConfig(store_dir=None), **MODES[mode]))


def summarise(requests, t0: float) -> dict:
    followers = requests[1:]
    return {
        "computed": sum(r.sources()["recomputed"] for r in requests),
        "reused_per_follower": statistics.mean(r.restored.num_pages * r.page_size for r in followers)
        if followers
        else 0,
        "mean_ttft": statistics.mean(r.t_first_token - r.t_submit for r in requests),
        "slowest": max(r.t_done for r in requests) - t0,
    }


def burst(loaded, mode: str, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine = engine_for(loaded, mode)
    t0 = time.perf_counter()
    requests = engine.generate(prompts, params)
    engine.close()
    return summarise(requests, t0)


def arrives_in_decode(loaded, mode: str, p: list[int], params: SamplingParams) -> dict:
    """The second identical request arrives just after the first's first token."""
    engine = engine_for(loaded, mode)
    t0 = time.perf_counter()
    first = engine.submit(p, params)
    while first.t_first_token is None:
        engine.step()
    second = engine.submit(p, params)
    engine.run()
    engine.close()
    return summarise([first, second], t0)


def show(title: str, rows: dict[str, dict]) -> None:
    print(title)
    print(f"  {'mode':>20} {'computed':>9} {'reused/follower':>16} {'mean TTFT s':>12} {'slowest s':>10}")
    for mode, r in rows.items():
        print(
            f"  {mode:>20} {r['computed']:>9} {r['reused_per_follower']:>16.0f} "
            f"{r['mean_ttft']:>12.3f} {r['slowest']:>10.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs of the distinct-prompt control")
    args = parser.parse_args()
    loaded = load_model()
    params = SamplingParams(max_tokens=args.max_tokens)
    print(f"BLAS: {blas_in_use()}; page 128 tokens; prompt {args.tokens} tokens; {args.max_tokens} output tokens")
    burst(loaded, "incremental", [prompt(64, 999)], SamplingParams(max_tokens=2))  # warm-up
    for n in args.sizes:
        rows = {mode: burst(loaded, mode, [prompt(args.tokens, n)] * n, params) for mode in MODES}
        show(f"{n} identical cold arrivals", rows)
        base = rows["completion-publish"]["mean_ttft"]
        print(f"  sf-after-prefill mean TTFT / completion-publish: {rows['sf-after-prefill']['mean_ttft'] / base:.2f}")
        runs: dict[str, list[dict]] = {"incremental": [], "sf-after-prefill": []}
        for repeat in range(args.repeats):  # interleaved: the machine's drift hits both alike
            distinct = [prompt(args.tokens, 1000 * repeat + 100 * n + i) for i in range(n)]
            for mode in runs:
                runs[mode].append(burst(loaded, mode, distinct, params))
        control = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
        show(f"{n} distinct prompts (control, median of {args.repeats})", control)
        for key in ("mean_ttft", "slowest"):
            ratio = control["sf-after-prefill"][key] / control["incremental"][key]
            print(f"  single flight / off, {key}: {ratio:.3f}")
    rows = {
        mode: arrives_in_decode(loaded, mode, prompt(args.tokens, 7), params)
        for mode in ("sf-at-completion", "sf-after-prefill")
    }
    show("second request arrives just after the first enters decode", rows)


if __name__ == "__main__":
    main()
