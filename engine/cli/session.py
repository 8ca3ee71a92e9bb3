"""The engine that ``run`` and ``serve`` open from the shared engine flags, and its close."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.tiers.hierarchy import StoreConfig

from ..interrupts import deferred_interrupt
from .calibrate import calibrate_on_first_use
from .common import UsageError, page_geometry
from .encryption import record_cipher

if TYPE_CHECKING:
    from ..engine import Engine


def open_engine(args: argparse.Namespace, loaded, store_dir: Path | None, **config) -> Engine:
    """The engine and store that the shared engine flags describe (``run``, ``serve``):
    the store calibrated on its first use, every construction error one line."""
    from ..engine import Engine, EngineConfig
    from ..models.load import ModelError

    geometry = page_geometry(loaded, args.page_size, (args.codec, args.l2_codec))
    cipher = record_cipher(args, store_dir)
    if store_dir is not None and not (args.no_auto_calibrate or os.environ.get("KVTIER_NO_AUTO_CALIBRATE")):
        calibrate_on_first_use(loaded, geometry, store_dir, args.codec, args.l2_codec)
    store = StoreConfig(
        args.l1_bytes,
        args.l2_bytes,
        args.l3_bytes,
        store_dir,
        args.codec,
        l2_codec=args.l2_codec,
        throttle=dict(args.throttle),
        label=loaded.label,
        cipher=cipher,
        l3_write_budget=args.l3_write_budget,
        l3_write_through=args.l3_write_through,
    )
    try:
        return Engine(
            loaded,
            EngineConfig(
                page_size=args.page_size,
                offload=store_dir is not None,
                store=store,
                cache_salt=args.cache_salt,
                single_flight=args.single_flight,
                refresh_window=args.refresh_window,
                policy=args.policy,
                **config,
            ),
        )
    except (ModelError, ValueError) as err:
        raise UsageError(str(err)) from None


def close_engine(engine: Engine, cancel: bool, timeout_s: float | None = None) -> int | None:
    """Close with Ctrl-C held until the store's flush is done; after an interruption,
    the requests still running are cancelled first (their published pages stay),
    instead of being run to the end. ``timeout_s``: see ``Engine.close`` (the pages
    not flushed when it ran out, else None)."""
    with deferred_interrupt():
        if cancel:
            engine.stop(cancel=True)
        return engine.close(timeout_s)
