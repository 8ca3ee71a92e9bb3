"""Snapshot spacing of a hybrid model: the cost model's choice against fixed grids.

    python bench/snapshot_spacing.py [--prompt 8192] [--page 256] [--per-token-ms 0.2]
                                     [--state-mib 1 32]

Predicted figures, from the cost model only (``costmodel.spacing``; links at the
uncalibrated defaults, prefill at ``--per-token-ms`` a token): for each state size, the
spacing ``choose_spacing`` picks for one prompt, and for it and for fixed grids of 512
and 2048 tokens, the seconds the snapshots add to that prompt's prefill, and the seconds
a later prompt sharing a prefix of it (ending at a page boundary, each equally likely)
spends recomputing past the snapshot before that end, on average. Their sum is what
the choice minimises; ratios are against the 2048-token grid.
"""

from __future__ import annotations

import argparse

from kvtier.costmodel.models import ComputeModel
from kvtier.costmodel.profile import Profile
from kvtier.costmodel.spacing import choose_spacing, snapshot_cost


def figures(profile: Profile, page: int, prompt: int, state: int, spacing: int) -> tuple[float, float]:
    """(seconds the snapshots add to the prefill, mean seconds recomputed after a restore)."""
    pages = (prompt - 1) // page
    take = snapshot_cost(profile, page, state, prompt // 2)
    lost = sum(profile.compute.predict((end % spacing) * page, prompt // 2) for end in range(1, pages + 1)) / pages
    return -(-pages // spacing) * take, lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=8192)
    parser.add_argument("--page", type=int, default=256)
    parser.add_argument("--per-token-ms", type=float, default=0.2)
    parser.add_argument("--state-mib", type=float, nargs="+", default=[1.0, 32.0])
    args = parser.parse_args()
    profile = Profile(Profile.defaults().links, ComputeModel([5e-3, args.per_token_ms / 1e3, 0.0]))
    print(f"prompt {args.prompt} tokens, page {args.page}, prefill {args.per_token_ms} ms/token (predicted)")
    print(f"{'state':>9} {'spacing':>16} {'prefill +s':>10} {'restore +s':>10} {'sum':>8} {'vs 2048':>8}")
    for mib in args.state_mib:
        state = int(mib * (1 << 20))
        chosen = choose_spacing(profile, args.page, state, args.prompt)
        grid = {"chosen": chosen, "512 tokens": 512 // args.page or 1, "2048 tokens": 2048 // args.page or 1}
        base = sum(figures(profile, args.page, args.prompt, state, grid["2048 tokens"]))
        for name, spacing in grid.items():
            added, lost = figures(profile, args.page, args.prompt, state, spacing)
            label = f"{name} ({spacing * args.page})" if name == "chosen" else name
            total = added + lost
            print(f"{mib:>6} MiB {label:>16} {added:>10.3f} {lost:>10.3f} {total:>8.3f} {total / base:>7.2f}x")


if __name__ == "__main__":
    main()
