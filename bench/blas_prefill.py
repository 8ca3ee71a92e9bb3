"""Prefill speed under each BLAS mlx can bind to on Linux (issue 21).

    python bench/blas_prefill.py [--model kvtier-tiny] [--tokens 512] [--repeats 3]

Runs one child process per BLAS, interleaved ``--repeats`` times (this kind of machine
drifts; every figure is the best of its runs): mlx's reference BLAS
(``KVTIER_NO_OPENBLAS=1``), the system OpenBLAS (if installed) and the cmeel-openblas
wheel's (loaded by hand before mlx, as ``kvtier.engine.blas`` does when the system has
none). Each child times one forward pass of ``--tokens`` tokens after a warm-up and
reports ``blas_in_use()``; the ratios to the reference BLAS are printed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time


def child(model: str, tokens: int, library: str | None) -> None:
    if library:
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import kvtier  # noqa: F401  (KVTIER_NO_OPENBLAS=1 in every child: it preloads nothing itself)
    from kvtier.engine.blas import blas_in_use
    from kvtier.engine.models.load import load_model

    net = load_model(model).model
    ids = mx.array([[(i * 31) % 200 + 32 for i in range(tokens)]])
    mx.eval(net(ids[:, :8]))
    cache = make_prompt_cache(net)
    t0 = time.perf_counter()
    mx.eval(net(ids, cache=cache))
    print(json.dumps({"seconds": time.perf_counter() - t0, "blas": blas_in_use()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="kvtier-tiny")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.model, args.tokens, args.child or None)

    from kvtier.engine.blas import SYSTEM_LIBRARY, wheel_library

    setups = {"reference": ""}
    try:
        ctypes.CDLL(SYSTEM_LIBRARY)
        setups["system OpenBLAS"] = SYSTEM_LIBRARY
    except OSError:
        pass
    if wheel := wheel_library():
        setups["wheel OpenBLAS"] = str(wheel)
    env = {**os.environ, "KVTIER_NO_OPENBLAS": "1"}
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, library in setups.items():
            done = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens), "--child", library],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            run = json.loads(done.stdout.splitlines()[-1])
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    reference = best["reference"]["seconds"]
    for name, run in best.items():
        print(f"{name:<16} {run['seconds'] * 1e3:8.1f} ms  {reference / run['seconds']:5.1f}x  {run['blas']}")


if __name__ == "__main__":
    main()
