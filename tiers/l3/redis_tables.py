"""The side tables of a Redis store (``tiers.l3.tables``), each a hash under the store's
prefix: ``meta`` (``user/<name>`` -> msgpack), ``counters`` (cumulative counters
flattened to ``a/b/c`` -> number, added with HINCRBY / HINCRBYFLOAT so concurrent
engines never lose an update) and ``ns`` (namespace digest -> msgpack row).

Every call is one server command (or one pipeline) through the store's ``call``, which
answers a default while the server is down (``RedisTier._call``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from .tables import SideTables

Call = Callable[[str, Callable[[], Any], Any], Any]  # RedisTier._call: (what, call, default)


def _flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, int | float]]:
    for name, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{name}/")
        else:
            yield f"{prefix}{name}", value


def _number(text: bytes) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


class RedisTables(SideTables):
    """Side tables of the store under ``prefix`` on ``client``."""

    def __init__(self, client: Any, prefix: bytes, call: Call, *, readonly: bool) -> None:
        self._client, self._call, self._readonly = client, call, readonly
        self._meta, self._counters, self._ns = (prefix + name for name in (b"meta", b"counters", b"ns"))

    def get_meta(self, name: str) -> object | None:
        stored = self._call("meta read", lambda: self._client.hget(self._meta, f"user/{name}"), None)
        return None if stored is None else msgpack.unpackb(stored)

    def put_meta(self, name: str, value: object) -> None:
        self._call("meta write", lambda: self._client.hset(self._meta, f"user/{name}", msgpack.packb(value)), 0)

    def add_persistent_counters(self, delta: dict) -> None:
        def add() -> list:
            pipe = self._client.pipeline(transaction=False)
            for field, n in _flatten(delta):
                if isinstance(n, float):
                    pipe.hincrbyfloat(self._counters, field, n)
                else:
                    pipe.hincrby(self._counters, field, n)
            return pipe.execute()

        self._call("counters write", add, [])

    def persistent_counters(self) -> dict:
        flat = self._call("counters read", lambda: self._client.hgetall(self._counters), {})
        tree: dict = {}
        for field, value in flat.items():
            *path, name = field.decode().split("/")
            node = tree
            for part in path:
                node = node.setdefault(part, {})
            node[name] = _number(value)
        return tree

    def reset_counters(self) -> None:
        self._call("counters write", lambda: self._client.delete(self._counters), 0)

    def namespaces(self) -> dict[bytes, dict]:
        rows = self._call("namespaces read", lambda: self._client.hgetall(self._ns), {})
        return {bytes(digest): msgpack.unpackb(row) for digest, row in rows.items()}

    def describe_namespace(self, digest: bytes, about: dict) -> None:
        """Record what a namespace is. Redis evicts on its own, so the store cannot count
        a namespace's pages: the row holds what it is and when it was last opened."""
        row = {"pages": 0, "bytes": 0, "tokens": 0, "last_use": time.time(), "about": about}
        if not self._readonly:
            self._call("namespaces write", lambda: self._client.hset(self._ns, digest, msgpack.packb(row)), 0)
