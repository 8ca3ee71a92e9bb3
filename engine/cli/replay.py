"""``kvtier replay``: replay a Mooncake trace against the store to size the tiers and choose the policy."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kvtier.costmodel.bounds import BELADY
from kvtier.costmodel.fleet_replay import MAX_IMBALANCE, ROUTES
from kvtier.tiers.policy import ADMISSIONS, DEFAULT_POLICY, POLICIES

from ..models.paths import default_store_dir
from .args import (
    l2_sweep,
    name_list,
    non_negative_int,
    parse_size,
    positive_int,
    positive_number,
    rate_list,
    store_arg,
)
from .common import THROUGH_WITH_BUDGET, UsageError, load_model, no_data
from .tree import Tree


def add_replay_parser(tree: Tree, sub) -> None:
    replay = tree.command(sub, "replay", "replay a Mooncake trace against the store: size the tiers, choose the policy")
    replay.add_argument("trace", type=Path, metavar="TRACE.jsonl")
    replay.add_argument("--page-size", type=positive_int, default=512, help="divides 512")
    geometry = replay.add_mutually_exclusive_group()
    geometry.add_argument(
        "--kv-bytes-per-token",
        type=positive_int,
        metavar="N",
        help="full-size KV bytes of one token (default: the model's)",
    )
    geometry.add_argument("--model", help="take the KV size (and the calibrated profile) from this model")
    replay.add_argument(
        "--state-bytes",
        type=parse_size,
        metavar="S",
        help="with --kv-bytes-per-token: a hybrid model's state snapshot size (default 0: no state layers; "
        "a --model's is its own)",
    )
    replay.add_argument("--store", type=store_arg, default=None, help="where the model's calibrated profile is")
    replay.add_argument("--profile", type=Path, metavar="FILE.json", help="a saved cost profile to use")
    replay.add_argument("--l1-bytes", type=parse_size, default=parse_size("1GiB"))
    replay.add_argument("--l2-bytes", type=parse_size, default=parse_size("4GiB"))
    replay.add_argument("--l3-bytes", type=parse_size, default=parse_size("32GiB"))
    replay.add_argument(
        "--policy",
        type=name_list([*POLICIES, "belady"]),
        help=f"comma-separated, each replayed: {','.join(POLICIES)} (default: all), or belady (the "
        f"offline bound for the same total capacity); with --engines one (default {DEFAULT_POLICY})",
    )
    replay.add_argument(
        "--l3-admit",
        type=name_list(ADMISSIONS),
        default=["always"],
        help=f"comma-separated L3 admission filters: {','.join(ADMISSIONS)}",
    )
    replay.add_argument(
        "--l3-write-budget",
        type=rate_list,
        default=[None],
        metavar="RATE,...",
        help="comma-separated, each replayed: L3 writes at most at RATE of the trace's time (e.g. 20GiB/day, "
        "1GiB/h), the pages of highest expected saving first; none: unbudgeted",
    )
    replay.add_argument("--sweep", type=l2_sweep, metavar="l2-bytes=S,S,...", help="replay at each L2 size")
    replay.add_argument(
        "--speed",
        type=positive_number,
        default=1.0,
        help="arrival timestamps divided by this (0.02 stretches them 50 times)",
    )
    replay.add_argument("--json", action="store_true", help="one JSON object")
    replay.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="reused ratio and TTFT against L2 size per policy (needs matplotlib)",
    )
    replay.add_argument("--engines", type=positive_int, metavar="N", help="a fleet: N engines sharing one L3")
    replay.add_argument(
        "--route",
        type=name_list(ROUTES),
        help=f"with --engines: comma-separated, each replayed: {','.join(ROUTES)} (default: all)",
    )
    replay.add_argument(
        "--l3-write-through",
        action="store_true",
        help="with --engines: replay each route also with the shared L3 written through (each page queued "
        "for L3 when published, as `serve --l3-write-through`), beside write-back",
    )
    replay.add_argument(
        "--max-imbalance",
        type=non_negative_int,
        metavar="N",
        help=f"with --engines, cache-aware: pass over an engine with N more requests than the least "
        f"loaded one (default {MAX_IMBALANCE})",
    )


def cmd_replay(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.costmodel import replay as rp
    from kvtier.costmodel.plan import Profile
    from kvtier.costmodel.replay_report import format_report, plot_report
    from kvtier.costmodel.trace import BLOCK_TOKENS, TraceError, read_trace

    _check_replay_args(args, BLOCK_TOKENS)
    try:
        trace = read_trace(args.trace)
        profile = Profile.from_dict(json.loads(args.profile.read_text())) if args.profile else None
    except TraceError as err:
        raise UsageError(str(err)) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"cannot read profile {args.profile}: {err}") from None
    bytes_per_token, state_bytes = args.kv_bytes_per_token, args.state_bytes or 0
    if bytes_per_token is None:
        bytes_per_token, state_bytes, saved = _model_geometry(args)
        profile = profile or saved
    base = rp.ReplayConfig(
        bytes_per_token,
        args.page_size,
        args.l1_bytes,
        args.l2_bytes,
        args.l3_bytes,
        speed=args.speed,
        snapshot_bytes=state_bytes,
    )
    if args.engines is not None:
        one = replace(
            base,
            policy=(args.policy or [DEFAULT_POLICY])[0],
            l3_admit=args.l3_admit[0],
            l3_write_budget=args.l3_write_budget[0],
        )
        return _replay_fleet(args, trace, one, profile)
    configs = rp.configs_for(base, args.policy or list(POLICIES), args.l3_admit, args.sweep or (), args.l3_write_budget)
    replays = sum(c.policy != BELADY for c in configs)
    with tqdm(total=len(trace) * replays, desc="replaying", unit="req", file=sys.stderr) as bar:
        report = rp.replay(trace, configs, profile or Profile.defaults(), lambda: bar.update())
    if args.plot is not None:
        plot_report(report, args.plot)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _replay_fleet(args: argparse.Namespace, trace, config, profile) -> int:
    """``--engines N``: the fleet replayed once per route (``costmodel.fleet_replay``)."""
    from tqdm import tqdm

    from kvtier.costmodel import fleet_replay as fr
    from kvtier.costmodel.plan import Profile

    routes = args.route or list(fr.ROUTES)
    imbalance = fr.MAX_IMBALANCE if args.max_imbalance is None else args.max_imbalance
    modes = (False, True) if args.l3_write_through else (False,)
    with tqdm(total=len(trace) * len(routes) * len(modes), desc="replaying", unit="req", file=sys.stderr) as bar:
        report = fr.replay_routes(
            trace, config, profile or Profile.defaults(), args.engines, routes, imbalance, lambda: bar.update(), modes
        )
    print(json.dumps(report) if args.json else fr.format_fleet(report))
    return 0


def _check_fleet_args(args: argparse.Namespace) -> None:
    """What a fleet replay takes: one policy and admission, no sweep; routes only with it."""
    if args.engines is None:
        for flag, value in (("--route", args.route), ("--max-imbalance", args.max_imbalance)):
            if value is not None:
                raise UsageError(f"{flag} goes with --engines")
        if args.l3_write_through:
            raise UsageError("--l3-write-through goes with --engines (an L3 that several engines share)")
        return
    if args.policy is not None and (len(args.policy) > 1 or args.policy[0] == BELADY):
        raise UsageError("--engines replays one --policy (not belady)")
    for flag, given in (
        ("--sweep", args.sweep),
        ("--plot", args.plot),
        ("a second --l3-admit", args.l3_admit[1:]),
        ("a second --l3-write-budget", args.l3_write_budget[1:]),
    ):
        if given:
            raise UsageError(f"--engines replays one configuration: {flag} does not go with it")
    if args.l3_write_through and args.l3_write_budget[0] is not None:
        raise UsageError(THROUGH_WITH_BUDGET)


def _check_replay_args(args: argparse.Namespace, block_tokens: int) -> None:
    if block_tokens % args.page_size:
        raise UsageError(f"--page-size {args.page_size} does not divide {block_tokens}")
    if args.state_bytes is not None and args.kv_bytes_per_token is None:
        raise UsageError("--state-bytes goes with --kv-bytes-per-token (a --model's state size is its own)")
    if not args.speed > 0:
        raise UsageError("--speed must be positive")
    _check_fleet_args(args)
    if args.plot is not None and not args.sweep:
        raise UsageError("--plot draws against L2 size: give --sweep l2-bytes=...")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None


def _model_geometry(args: argparse.Namespace):
    """The model's KV bytes per token, its state snapshot bytes (0 without state layers),
    and the profile calibrated for it in the store (None without one, or when
    ``--profile`` gave one: the store is then not opened)."""
    from kvtier.costmodel.plan import Profile
    from kvtier.tiers.l3.open import StoreError, open_l3

    loaded = load_model(args.model)
    geometry = loaded.geometry(args.page_size)
    store_dir = args.store or default_store_dir()
    if args.profile is not None or no_data(store_dir):
        return geometry.bytes_per_token, geometry.snapshot_nbytes, None
    try:
        disk = open_l3(store_dir, readonly=True)
    except StoreError as err:
        raise UsageError(str(err)) from None
    key = loaded.profile_key(geometry)
    profile = Profile.stored(disk.tables.get_meta(key), key)
    disk.close()
    return geometry.bytes_per_token, geometry.snapshot_nbytes, profile
