"""Encryption at rest of L3 records (``--encrypt-l3``, DESIGN §4): AES-256-GCM, one key
per namespace, a fresh 12-byte random nonce per record.

The key of a namespace comes from ``key_of(namespace digest)``; the command line passes
``functools.partial(tiers.l3.secret.derive, secret, b"encrypt")``, so it is
``HMAC(server secret, "encrypt" || digest)`` and nobody without the secret can compute it
(the secret is never stored in L3). A tenant's namespace has its own digest, so its key
is its own too; binding a tenant tag explicitly is one more part passed to ``derive``.

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
import threading
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

    def __init__(self, key_of: Callable[[bytes], bytes], key_id: str) -> None:
        """``key_of``: namespace digest -> 32-byte key; ``key_id``: names the secret they
        come from, revealing nothing of it (for example a prefix of another HMAC of it)."""
        self.name = f"{self.algorithm}/{key_id}"  # what a namespace records (``Namespace.encryption``)
        self._key_of = key_of
        self._aeads: dict[bytes, AESGCM] = {}
        self._lock = threading.Lock()

    def _aead(self, namespace: bytes) -> AESGCM:
        with self._lock:
            if (aead := self._aeads.get(namespace)) is None:
                aead = self._aeads[namespace] = AESGCM(self._key_of(namespace))
        return aead

    @staticmethod
    def nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def seal(self, namespace: bytes, nonce: bytes, plain: bytes, associated: bytes) -> bytes:
        """``plain`` encrypted under the namespace's key, its tag appended."""
        return self._aead(namespace).encrypt(nonce, plain, associated)

    def open(
        self,
        namespace: bytes,
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
        aead = self._aead(namespace)
        try:
            if into is None:
                return aead.decrypt(nonce, sealed, associated)
            aead.decrypt_into(nonce, sealed, associated, into.data)
            return into
        except InvalidTag:
            return None
