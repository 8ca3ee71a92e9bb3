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

from .tables import DamageLog, SideTables, is_counter_tree, is_namespace_row, unpacked

Call = Callable[[str, Callable[[], Any], Any], Any]  # RedisTier._call: (what, call, default)


def _flatten(tree: dict, prefix: str = "") -> Iterator[tuple[str, int | float]]:
    for name, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{name}/")
        else:
            yield f"{prefix}{name}", value


def counter_number(text: bytes | str) -> int | float | None:
    """A counter field's number; None when it holds something else (damaged)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return None


class RedisTables(SideTables):
    """Side tables of the store under ``prefix`` on ``client``. A damaged value is one
    warning (``DamageLog``) and its fallback; a writable store is repaired."""

    def __init__(self, client: Any, prefix: bytes, call: Call, damage: DamageLog, *, readonly: bool) -> None:
        self._client, self._call, self._readonly, self._damage = client, call, readonly, damage
        self._meta, self._counters, self._ns = (prefix + name for name in (b"meta", b"counters", b"ns"))

    def get_meta(self, name: str) -> object | None:
        stored = self._call("meta read", lambda: self._client.hget(self._meta, f"user/{name}"), None)
        readable, value = unpacked(stored)
        if not readable:
            self._damage.report(f"meta entry {name}", "read as absent")
        return value

    def put_meta(self, name: str, value: object) -> None:
        self._call("meta write", lambda: self._client.hset(self._meta, f"user/{name}", msgpack.packb(value)), 0)

    def add_persistent_counters(self, delta: dict) -> None:
        flat = list(_flatten(delta))

        def add() -> list:
            pipe = self._client.pipeline(transaction=False)
            for field, n in flat:
                if isinstance(n, float):
                    pipe.hincrbyfloat(self._counters, field, n)
                else:
                    pipe.hincrby(self._counters, field, n)
            return pipe.execute(raise_on_error=False)

        results = self._call("counters write", add, [])
        damaged = {field: n for (field, n), result in zip(flat, results) if isinstance(result, Exception)}
        if damaged:  # a field holding no number refuses HINCRBY: it counts from zero
            self._damage.report("cumulative counters", "counting from zero")
            self._call("counters write", lambda: self._client.hset(self._counters, mapping=damaged), 0)

    def persistent_counters(self) -> dict:
        flat = self._call("counters read", lambda: self._client.hgetall(self._counters), {})
        tree: dict = {}
        for field, value in flat.items():
            number = counter_number(value)
            if number is None:
                self._damage.report("cumulative counters", "counting from zero")
                continue
            *path, name = field.decode(errors="replace").split("/")
            node = tree
            for part in path:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    break
            else:
                node[name] = number
        return tree if is_counter_tree(tree) else {}

    def reset_counters(self) -> None:
        self._call("counters write", lambda: self._client.delete(self._counters), 0)

    def namespaces(self) -> dict[bytes, dict]:
        """The namespace rows; a damaged one is dropped (Redis counts no pages to rebuild
        it from: the next engine of that namespace describes it again)."""
        rows = self._call("namespaces read", lambda: self._client.hgetall(self._ns), {})
        sound, damaged = {}, []
        for digest, stored in rows.items():
            readable, row = unpacked(stored)
            if readable and is_namespace_row(row):
                sound[bytes(digest)] = row
            else:
                damaged.append(digest)
        if damaged:
            self._damage.report("namespaces table", "its damaged rows dropped")
            if not self._readonly:
                self._call("namespaces write", lambda: self._client.hdel(self._ns, *damaged), 0)
        return sound

    def describe_namespace(self, digest: bytes, about: dict) -> None:
        """Record what a namespace is. Redis evicts on its own, so the store cannot count
        a namespace's pages: the row holds what it is and when it was last opened."""
        row = {"pages": 0, "bytes": 0, "tokens": 0, "last_use": time.time(), "about": about}
        if not self._readonly:
            self._call("namespaces write", lambda: self._client.hset(self._ns, digest, msgpack.packb(row)), 0)
