"""What the commands share: the usage error, the store they name, the model they load."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.lmdb_open import read_only_store, writable_directory
from kvtier.tiers.l3.tables import log as damage_log
from kvtier.tiers.text import format_bytes

from ..blas import blas_in_use, openblas_hint
from ..models.paths import default_store_dir

if TYPE_CHECKING:
    from tqdm import tqdm


class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit status 2."""


class OncePerLine(logging.Filter):
    """Drop a warning about a damaged side value (``tiers.l3.tables.DamageLog``) whose
    text this command already printed: a command may open its store more than once (a
    read-only look, then the real work), and the person at the terminal needs to hear
    about one damaged value once. Other warnings pass: they say what happened each time."""

    def __init__(self) -> None:
        super().__init__()
        self._said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != damage_log.name:
            return True
        text = record.getMessage()
        fresh = text not in self._said
        self._said.add(text)
        return fresh


def no_data(store: Path | str) -> bool:
    """An LMDB directory holding no store yet (a URL always names a store to ask)."""
    return isinstance(store, Path) and not (store / "data.mdb").exists()


def usable_store(path: Path | None) -> Path:
    """The store directory the user named (or the default), created if missing; a file
    or a directory kvtier cannot write is the user's error, not a reason to run without
    L3, unless it holds a store: that one is restored from (its opening warns)."""
    path = path or default_store_dir()
    if isinstance(path, str):  # a URL: the engine warns and runs without L3 if it cannot be reached
        return path
    if path.exists() and not path.is_dir():
        raise UsageError(f"store {path} is not a directory")
    if read_only_store(path):
        return path
    try:
        writable_directory(path)
    except StoreError as err:
        raise UsageError(str(err)) from None
    return path


# run, serve and replay refuse the two together (``StoreConfig`` does too)
THROUGH_WITH_BUDGET = (
    "--l3-write-through and --l3-write-budget exclude each other: the budget ranks pages as they spill"
)


def engine_store(args: argparse.Namespace) -> Path | None:
    """The store of ``run`` and ``serve`` (``usable_store``; None with ``--no-offload``).
    ``--l3-write-through`` is for an L3 that several engines share: it needs ``--store``,
    and no ``--l3-write-budget`` (which ranks the pages leaving L2, leaf-first)."""
    if args.l3_write_through and (args.no_offload or args.store is None):
        raise UsageError("--l3-write-through needs --store: the L3 that the engines of a fleet share")
    if args.l3_write_through and args.l3_write_budget is not None:
        raise UsageError(THROUGH_WITH_BUDGET)
    return None if args.no_offload else usable_store(args.store)


def open_store(path: Path | None, readonly: bool = False):
    """The store at ``path`` (it must exist): read-only for reports, writable to manage it."""
    from kvtier.tiers.l3.open import StoreError, open_l3

    path = path or default_store_dir()
    if no_data(path):
        raise UsageError(f"no kvtier store at {path}")
    try:
        return open_l3(path, readonly=readonly)
    except StoreError as err:
        raise UsageError(str(err)) from None


def pages_kept(args: argparse.Namespace | None) -> str:
    """What the store holds after an interrupted command (its writes were flushed)."""
    from kvtier.tiers.l3.open import StoreError, open_l3

    if args is None or not hasattr(args, "store") or getattr(args, "no_offload", False):
        return "no store in use"
    path = args.store or default_store_dir()
    try:
        with open_l3(path, readonly=True) as disk:
            return f"{disk.counters.pages} pages kept in {path}"
    except StoreError:
        return f"0 pages kept in {path}"


def check_sizes(args: argparse.Namespace, store_dir: Path | None) -> None:
    """L1 or L2 larger than the machine's memory is refused; an L3 cap larger than the
    free disk space is allowed (the file grows with the data) with a warning."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for flag, size in (("--l1-bytes", args.l1_bytes), ("--l2-bytes", args.l2_bytes)):
        if size > memory:
            raise UsageError(f"{flag} {format_bytes(size)} is more than this machine's memory ({format_bytes(memory)})")
    if isinstance(store_dir, Path) and args.l3_bytes is not None:
        free = shutil.disk_usage(store_dir).free
        if args.l3_bytes > free:
            print(
                f"kvtier: warning: --l3-bytes {format_bytes(args.l3_bytes)} is more than the free space "
                f"under {store_dir} ({format_bytes(free)}): the disk fills before the cap",
                file=sys.stderr,
            )


def load_model(name: str | None):
    from ..models.defaults import REAL_MODEL_HINT, TINY_MODEL
    from ..models.load import ModelError, default_model_name
    from ..models.load import load_model as load

    logging.getLogger("kvtier").info("BLAS: %s", blas_in_use())
    if hint := openblas_hint():  # for the person at the terminal; scripts and logs get it with -v
        if sys.stderr.isatty():
            print(f"kvtier: {hint}", file=sys.stderr)
        else:
            logging.getLogger("kvtier").info(hint)
    if name is None and default_model_name() == TINY_MODEL:
        print(
            f"kvtier: using the generated test model {TINY_MODEL} (its text is gibberish); {REAL_MODEL_HINT}",
            file=sys.stderr,
        )
    with ProgressBar("importing model") as bar:
        try:
            return load(name, progress=bar.update)
        except ModelError as err:
            raise UsageError(str(err)) from None


class ProgressBar:
    """A tqdm bar on stderr that appears only once there is progress to show."""

    def __init__(self, desc: str) -> None:
        self.desc = desc
        self.bar: tqdm | None = None

    def update(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, file=sys.stderr)
        self.bar.update(done - self.bar.n)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def page_geometry(loaded, page_size: int, codecs: Sequence[str] = ()):
    """The model's page geometry; a model kvtier cannot use, or a page codec (of
    ``codecs``) that cannot encode its pages, is the user's error, before any work."""
    from kvtier.tiers.quant import PageCodec

    from ..models.load import ModelError

    try:
        geometry = loaded.geometry(page_size)
        for codec in codecs:
            PageCodec.of(geometry, codec)
        return geometry
    except (ModelError, ValueError) as err:
        raise UsageError(str(err)) from None
