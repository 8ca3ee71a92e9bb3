"""Engine overhead on all-unique prompts, as ratios measured in one run.

    python bench/engine_overhead.py [--prompts 8] [--tokens 600] [--max-tokens 32] [--repeats 5]
                                    [--l2-codec raw|q8|q4|k8v4] [--l3-codec raw|zstd|q8|q4|k8v4]

Three ways to run the same burst of unique prompts (nothing to reuse):
- ``mlx_lm``: mlx-lm's own ``BatchGenerator``, prompts inserted together;
- ``off``: the kvtier engine with ``offload=False`` (no store);
- ``on``: the engine with offload on, a fresh store per run (publication after every
  step, L1 inserts; ``close`` flushes to L3 and is timed separately), its tiers'
  codecs those of ``--l2-codec`` and ``--l3-codec`` (a quantizing L3 encodes every
  page that its flush writes).
Runs are interleaved and repeated, each repeat in a rotated order (so a machine
slowing down or speeding up favours none of them); the median of each is reported,
and the on/off ratio within each repeat (its median and range: how far the machine's
noise moves one ratio).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from kvtier.engine.blas import blas_in_use
from kvtier.engine.cli.args import add_codec_flag
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig


def unique_prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    return [[(seed * 7919 + i * 131 + j * 17) % 250 + 3 for j in range(tokens)] for i in range(count)]


def run_mlx_lm(loaded, prompts, max_tokens) -> float:
    t0 = time.perf_counter()
    generator = BatchGenerator(
        loaded.model, stop_tokens=[[t] for t in loaded.tokenizer.eos_token_ids], prefill_step_size=512
    )
    generator.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    remaining = len(prompts)
    while remaining:
        _, responses = generator.next()
        remaining -= sum(r.finish_reason is not None for r in responses)
    generator.close()
    return time.perf_counter() - t0


def run_engine(loaded, prompts, max_tokens, offload: bool, codecs=("raw", "raw")) -> tuple[float, float, float]:
    """Seconds of the run, of its close, and inside the store; ``codecs``: L2's and L3's."""
    with tempfile.TemporaryDirectory() as tmp:
        store = StoreConfig(store_dir=Path(tmp), l2_codec=codecs[0], codec=codecs[1])
        config = EngineConfig(offload=offload, store=store, prefill_step_size=512)
        t0 = time.perf_counter()
        engine = Engine(loaded, config)
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
        seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        engine.close()
        return seconds, time.perf_counter() - t1, engine.totals.store_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    add_codec_flag(parser)  # --l2-codec, --l3-codec: as kvtier run's
    args = parser.parse_args()
    loaded = load_model()
    times: dict[str, list[float]] = {"mlx_lm": [], "off": [], "on": [], "close": [], "store": []}
    run_mlx_lm(loaded, unique_prompts(2, 64, 999), 2)  # warm-up: kernels, allocator

    def on(prompts) -> None:
        seconds, close, store = run_engine(loaded, prompts, args.max_tokens, True, (args.l2_codec, args.codec))
        times["on"].append(seconds)
        times["close"].append(close)
        times["store"].append(store / seconds)

    ways = [
        lambda prompts: times["mlx_lm"].append(run_mlx_lm(loaded, prompts, args.max_tokens)),
        lambda prompts: times["off"].append(run_engine(loaded, prompts, args.max_tokens, offload=False)[0]),
        on,
    ]
    for repeat in range(args.repeats):
        prompts = unique_prompts(args.prompts, args.tokens, repeat)  # never seen before
        for way in ways[repeat % 3 :] + ways[: repeat % 3]:
            way(prompts)
            mx.clear_cache()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"BLAS: {blas_in_use()}")
    print(
        f"{args.prompts} unique prompts x {args.tokens} tokens, {args.max_tokens} output tokens, "
        f"median of {args.repeats}; offload on with L2 {args.l2_codec}, L3 {args.codec}"
    )
    for name in ("mlx_lm", "off", "on", "close"):
        print(f"  {name:>7}: {med[name]:7.3f} s")
    print(f"engine (offload off) throughput vs mlx_lm BatchGenerator: {med['mlx_lm'] / med['off']:.3f}x")
    print(
        f"offload on / off time: {med['on'] / med['off']:.3f} (plus close/flush to L3: "
        f"{med['close'] / med['off']:.3f} of a run)"
    )
    paired = sorted(on / off for on, off in zip(times["on"], times["off"]))
    print(
        f"offload on / off within each repeat (adjacent runs, the same stretch of the machine): "
        f"median {statistics.median(paired):.3f}, range {paired[0]:.3f}-{paired[-1]:.3f}"
    )
    print(f"time inside the store during offload-on runs (restore + publish): {med['store']:.2%} of the run")


if __name__ == "__main__":
    main()
