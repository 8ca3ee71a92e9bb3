"""``kvtier calibrate``, and the quick calibration a store gets on its first use."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtier.tiers.l3.lmdb_open import read_only_store

from .common import UsageError, load_model, no_data, page_geometry, usable_store


def calibrate_into(
    loaded,
    geometry,
    store_dir: Path,
    quick: bool = False,
    desc: str = "calibrating",
    codec: str = "raw",
    l2_codec: str = "raw",
):
    """Measure this machine (with a progress bar ``desc``) and save the profile in the
    store, under the key of the L3 ``codec`` and ``l2_codec`` it measured."""
    from tqdm import tqdm

    from kvtier.costmodel.calibrate import calibrate, steps
    from kvtier.tiers.l3.open import StoreError, open_l3
    from kvtier.tiers.quant import namespace_codecs

    try:
        total = steps(quick=quick, snapshots=bool(geometry.snapshot_nbytes))
        with tqdm(total=total, desc=desc, unit="sample", file=sys.stderr) as bar:
            profile = calibrate(loaded.model, geometry, store_dir, bar.update, quick, (codec, l2_codec))
        with open_l3(store_dir) as disk:
            disk.tables.put_meta(loaded.profile_key(geometry, namespace_codecs(codec, l2_codec)), profile.to_dict())
    except (OSError, StoreError) as err:
        raise UsageError(f"cannot calibrate with store {store_dir}: {err}") from None
    return profile


def calibrate_on_first_use(loaded, geometry, store_dir: Path, codec: str = "raw", l2_codec: str = "raw") -> None:
    """Calibrate once per store, model, page size and lossy codec (of L3, ``codec``, or
    of L2): the default cost model can be far off this machine, and online refinement
    needs many requests to correct it."""
    from kvtier.costmodel.profile import Profile
    from kvtier.tiers.l3.open import StoreError, open_l3
    from kvtier.tiers.quant import namespace_codecs

    if isinstance(store_dir, Path) and read_only_store(store_dir):
        return  # no profile could be kept: the engine uses the one the store holds, or defaults
    if not no_data(store_dir):
        key = loaded.profile_key(geometry, namespace_codecs(codec, l2_codec))
        try:
            with open_l3(store_dir, readonly=True) as disk:
                if Profile.stored(disk.tables.get_meta(key), key) is not None:  # a damaged one: measured anew
                    return
        except StoreError:
            return  # the engine warns and runs without L3
    print(  # the line and its end in one write: a Ctrl-C between them would join it to the next line
        f"kvtier: no cost profile for this model in {store_dir}: a quick calibration first "
        "(--no-auto-calibrate skips it; `kvtier calibrate` measures more)\n",
        end="",
        file=sys.stderr,
    )
    calibrate_into(loaded, geometry, store_dir, True, "calibrating (quick, first use)", codec, l2_codec)


def cmd_calibrate(args: argparse.Namespace) -> int:
    store_dir = usable_store(args.store)
    loaded = load_model(args.model)
    profile = calibrate_into(
        loaded,
        page_geometry(loaded, args.page_size, (args.codec, args.l2_codec)),
        store_dir,
        args.quick,
        "calibrating (quick)" if args.quick else "calibrating",
        args.codec,
        args.l2_codec,
    )
    summary = profile.summary()
    for name, link in summary.links.items():
        print(f"{name}: setup {link.setup_s * 1e3:.3f} ms, {link.gib_s:.2f} GiB/s")
    if (c := summary.compute) is not None:
        print(f"prefill: T(n, p) = {c.c0:.4g} + {c.c1:.4g}*n + {c.c2:.4g}*n*(p + n/2) s")
    print(f"profile saved in {store_dir}")
    return 0
