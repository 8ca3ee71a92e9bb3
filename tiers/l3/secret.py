"""The server secret: 32 random bytes that tenant namespaces and L3 encryption keys
are derived from (DESIGN §9a).

Kept in a file readable by its owner only: beside an LMDB store (``STORE/secret``), so
every process on that store derives the same tenant namespaces and keys, or where the
operator says (``--secret-file``; a fleet on one Redis shares one file). The secret is
never stored in L3 itself: whoever can read the records must not also read the key.
Created once, atomically (written whole, then linked in place): two processes starting
together agree on it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from .base import StoreError

SECRET_BYTES = 32
SECRET_FILE = "secret"


def read_or_create(path: Path) -> bytes:
    """The secret kept at ``path``, created (mode 0600) if there is none. StoreError when
    the file cannot be made or read, or holds anything but ``SECRET_BYTES`` bytes.

    A new secret is written whole to a file of its own, then linked in place (``link``
    fails if another process linked one first): a reader never sees a half-written one."""
    if not path.exists():
        _create(path)
    try:
        secret = path.read_bytes()
    except OSError as e:
        raise StoreError(f"cannot read the server secret {path}: {e.strerror or e}") from None
    if len(secret) != SECRET_BYTES:
        raise StoreError(f"the server secret {path} holds {len(secret)} bytes, not {SECRET_BYTES}")
    return secret


def _create(path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where the directory should be
        raise StoreError(f"cannot create the server secret {path}: Not a directory") from None
    except OSError as e:
        raise StoreError(f"cannot create the server secret {path}: {e.strerror or e}") from None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_bytes(SECRET_BYTES))
            out.flush()
            os.fsync(out.fileno())
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process made it first: both read that one
    except OSError as e:
        raise StoreError(f"cannot create the server secret {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def derive(secret: bytes, purpose: bytes, *parts: bytes) -> bytes:
    """A 32-byte key for ``purpose`` (for example ``b"tenant"``, ``b"encrypt"``) bound to
    ``parts``: HMAC-SHA256 under the secret, so nobody without it can compute one."""
    message = b"\0".join((purpose, *parts))
    return hmac.new(secret, message, hashlib.sha256).digest()
