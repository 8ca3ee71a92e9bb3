"""``kvtier bench restore`` and ``kvtier bench ttft``: measure the store on this machine."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..blas import blas_in_use
from .bench_report import format_restore, format_ttft, plot_restore, plot_ttft
from .common import UsageError, load_model, page_geometry, usable_store


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "ttft":
        return cmd_bench_ttft(args)
    from tqdm import tqdm

    from kvtier.costmodel import bandwidth

    if args.plot is not None:
        check_plot_path(args.plot)
    store_dir = usable_store(args.store)
    loaded = load_model(args.model)
    geometry = page_geometry(loaded, args.page_size, args.codecs)
    rounds = args.rounds or (bandwidth.QUICK_ROUNDS if args.quick else bandwidth.ROUNDS)
    pages = bandwidth.QUICK_PAGE_COUNTS if args.quick else bandwidth.PAGE_COUNTS
    with tqdm(total=bandwidth.steps(rounds, args.quick), desc="measuring", unit="step", file=sys.stderr) as bar:
        report = bandwidth.run(
            loaded.model, geometry, store_dir, bar.update, pages, rounds, args.quick, args.encrypt_l3, args.codecs
        )
    report["blas"] = blas_in_use()
    if args.json:
        print(json.dumps(report))
    else:
        print(format_restore(report))
    return save_plot(plot_restore, report, args.plot)


def cmd_bench_ttft(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.tiers.l3.open import StoreError

    from .. import bench_ttft

    _check_ttft_args(args)
    store_dir = usable_store(args.store)
    loaded = load_model(args.model)
    page_geometry(loaded, args.page_size)
    lengths = sorted(set(args.lengths or bench_ttft.default_lengths(loaded)))
    most = bench_ttft.context_tokens(loaded) - bench_ttft.FIRST_TOKEN.max_tokens
    if lengths[0] <= args.page_size or lengths[-1] > most:
        raise UsageError(
            f"--lengths must be from {args.page_size + 1} (a prompt holds a full page of "
            f"--page-size {args.page_size} before its last token) to {most} (the model's context "
            f"less the first token), got {','.join(map(str, lengths))}"
        )
    total = bench_ttft.runs_per_round(lengths, args.redis is not None, args.encrypt_l3) * args.rounds
    try:
        with tqdm(total=total, desc="measuring", unit="prompt", file=sys.stderr) as bar:
            report = bench_ttft.run(
                loaded, lengths, args.page_size, store_dir, args.redis, args.rounds, bar.update, args.encrypt_l3
            )
    except (bench_ttft.BenchError, StoreError) as err:
        print(f"kvtier: error: {err}", file=sys.stderr)
        return 1
    report["blas"] = blas_in_use()
    print(json.dumps(report) if args.json else format_ttft(report))
    return save_plot(plot_ttft, report, args.plot)


def _check_ttft_args(args: argparse.Namespace) -> None:
    """The flags that need no model: a directory store, a plot that can be written, a Redis that answers."""
    from kvtier.tiers.l3.open import StoreError, open_l3

    if isinstance(args.store, str):
        raise UsageError(f"--store {args.store}: give a directory here; --redis URL adds a Redis server")
    if args.plot is not None:
        check_plot_path(args.plot)
    if args.redis is not None:
        try:
            open_l3(args.redis, readonly=True).close()
        except StoreError as err:
            raise UsageError(str(err)) from None


def save_plot(draw: Callable[[dict, Path], None], report: dict, path: Path | None) -> int:
    """Draw ``report`` into ``path`` (if given); 1 with one line when that fails after measuring."""
    if path is None:
        return 0
    try:
        draw(report, path)
    except Exception as err:  # matplotlib and the filesystem raise many types
        print(f"kvtier: error: cannot draw {path}: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    return 0


def check_plot_path(path: Path) -> None:
    """Refuse a plot that cannot be written before measuring, not after."""
    if path.is_dir():
        raise UsageError(f"--plot {path} is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"--plot {path}: directory {parent} does not exist or is not writable")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    kinds = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in kinds:
        raise UsageError(f"--plot {path}: use one of the suffixes .{', .'.join(sorted(kinds))}")
