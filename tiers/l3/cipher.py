"""Encryption at rest of L3 records (``--encrypt-l3``, DESIGN §4): AES-256-GCM, one key
per record, a fresh 12-byte random nonce per record.

A record's key comes from ``key_of(namespace digest, page key)``; the command line passes
``functools.partial(tiers.l3.secret.derive, secret, b"encrypt")``, so it is
``HMAC(server secret, "encrypt" || digest || page key)`` and nobody without the secret
can compute it (the secret is never stored in L3). A page key chains from its tenant's
root (``tiers.page.ChainRoot``, itself an HMAC of the tenant's name under the same
secret), so every tenant's records are under keys of their own, and learning one
record's key opens no other record.

A namespace names its cipher with the key's id (``name``: ``aes-256-gcm/<id>``), so pages
under another secret, or plain ones, live under other page keys: a process given the
wrong secret or none misses them (and recomputes) instead of finding them, failing
their tags and deleting them from a store others share.

What is sealed and what is authenticated is the record's business (``tiers.l3.record``):
the caller passes the associated data (the page key and the record's header) and gets
``None`` back from ``open`` when the tag does not hold, for whatever reason (another key,
another header, a flipped byte). 96-bit random nonces under one key stay safe for about
2^32 records (NIST SP 800-38D); a namespace holds far fewer pages than that.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12
TAG_BYTES = 16


class RecordCipher:
    """Seal and open record payloads of any namespace; thread-safe (the writer thread
    seals, restore threads open)."""

    algorithm = "aes-256-gcm"

    def __init__(self, key_of: Callable[[bytes, bytes], bytes], key_id: str) -> None:
        """``key_of``: (namespace digest, page key) -> 32-byte key; ``key_id``: names the
        secret they come from, revealing nothing of it (for example a prefix of another
        HMAC of it)."""
        self.name = f"{self.algorithm}/{key_id}"  # what a namespace records (``Namespace.encryption``)
        self._key_of = key_of

    def _aead(self, namespace: bytes, key: bytes) -> AESGCM:
        return AESGCM(self._key_of(namespace, key))  # a key schedule per record: microseconds

    @staticmethod
    def nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def seal(self, namespace: bytes, key: bytes, nonce: bytes, plain: bytes, associated: bytes) -> bytes:
        """``plain`` encrypted under the key of page ``key`` in ``namespace``, its tag appended."""
        return self._aead(namespace, key).encrypt(nonce, plain, associated)

    def open(
        self,
        namespace: bytes,
        key: bytes,
        nonce: bytes,
        sealed: bytes | memoryview,
        associated: bytes,
        into: np.ndarray | None = None,
    ) -> bytes | np.ndarray | None:
        """The plain bytes of ``sealed`` (written into ``into`` when given, which must be
        their length: no copy of them is made), or None unless its tag holds for this
        key, nonce and associated data (``into`` then holds garbage)."""
        if len(nonce) != NONCE_BYTES or len(sealed) < TAG_BYTES:
            return None
        aead = self._aead(namespace, key)
        try:
            if into is None:
                return aead.decrypt(nonce, sealed, associated)
            aead.decrypt_into(nonce, sealed, associated, into.data)
            return into
        except InvalidTag:
            return None
