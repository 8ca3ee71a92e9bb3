"""``--encrypt-l3`` and ``--secret-file``: defined here once for every command that opens
an L3 for a model (``run``, ``serve``; ``bench restore`` takes ``--encrypt-l3`` alone), and
the record cipher they name (DESIGN §4).

The server secret is the one ``tiers.l3.secret`` keeps: ``STORE/secret`` beside an LMDB
store, so every process on that store derives the same keys; for a Redis URL (or when
``--secret-file`` names one) the file given, by default ``KVTIER_HOME/secret``: a fleet
on one Redis shares one file. Tenancy derives its tenant salts from the same secret.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.cipher import RecordCipher
from kvtier.tiers.l3.secret import SECRET_FILE, derive, read_or_create

from ..models.paths import kvtier_home
from .common import UsageError

ENCRYPT_HELP = (
    "encrypt L3 records at rest (AES-256-GCM, a key per namespace derived from the server "
    "secret); encrypted and plain pages never mix, and a store read without the key recomputes"
)


def add_encryption_flags(
    parser: argparse.ArgumentParser, *, secret_file: bool = True, help: str = ENCRYPT_HELP
) -> None:
    """``--encrypt-l3`` (and ``--secret-file``, unless the command keeps no secret)."""
    parser.add_argument("--encrypt-l3", action="store_true", help=help)
    if secret_file:
        parser.add_argument(
            "--secret-file",
            type=Path,
            metavar="PATH",
            help=f"the server secret ({SECRET_FILE}: 32 bytes, created mode 0600 if absent; default: "
            f"STORE/{SECRET_FILE} beside an LMDB store, else {kvtier_home() / SECRET_FILE})",
        )


def secret_path(args: argparse.Namespace, store: Path | str) -> Path:
    """Where the server secret of ``store`` is kept (``--secret-file`` wins)."""
    if args.secret_file is not None:
        return args.secret_file
    return store / SECRET_FILE if isinstance(store, Path) else kvtier_home() / SECRET_FILE


def record_cipher(args: argparse.Namespace, store: Path | str | None) -> RecordCipher | None:
    """The cipher ``--encrypt-l3`` asks for (None without it, or without a store);
    UsageError (one line) when the secret cannot be made or read, or is not 32 bytes."""
    if not args.encrypt_l3 or store is None:
        return None
    try:
        secret = read_or_create(secret_path(args, store))
    except StoreError as err:
        raise UsageError(str(err)) from None
    return RecordCipher(partial(derive, secret, b"encrypt"), derive(secret, b"encrypt-id")[:8].hex())
