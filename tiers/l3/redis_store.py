"""L3 for a fleet: pages in Redis / Valkey (standalone or Redis Cluster), shared by every
engine on every host that names the same server.

Keys, all under a prefix (``kvtier:`` unless the URL says ``?prefix=...``):
``<prefix>p:<16-byte page key>`` -> the record (``tiers.l3.record``, the same bytes LMDB
stores); ``<prefix>meta`` (hash: ``format_version``, and the side tables'
``user/<name>`` entries), ``<prefix>counters`` and ``<prefix>ns`` (``tiers.l3.redis_tables``).

What differs from LMDB, and why:
- Capacity and eviction are the server's (``maxmemory`` and ``maxmemory-policy``): a
  record can vanish at any moment, so a record found absent on read is a miss, like any
  other. ``capacity`` reports ``maxmemory`` (0: none set), ``bytes_used`` the server's
  ``used_memory``, ``pages`` its key count, ``evictions`` the server's evicted keys since
  this process opened the store. Open warns when there is no cap or the policy never evicts.
- Reads are copies into host memory, fetched in a few pipelined ``MGET`` s per restore
  (``Snapshot.expect``): a raw page is then joined from those bytes, as from LMDB's map.
  A sliding-window model's read ahead fetches with ``GETRANGE`` only what the restore
  joins: the global rows of most pages, whole records for the last ones
  (``tiers.l3.redis_snapshot``).
- Writes are ``SET NX`` (write-once) from the writer thread, after one pipelined
  ``EXISTS`` per batch so that a page the server holds is not sent again; deletes of rejected records
  are a server-side compare-and-delete on the SHA-1 of the value's ``record.fingerprinted``
  part, so a rewritten record survives.
- Leaf-first is the server's eviction helped, not enforced: the same pipeline ``TOUCH``es
  the page before each page written (``put(parent=...)``), so under an LRU or LFU
  ``maxmemory-policy`` a page is used at least as recently, and at least as often, as
  the pages written after it, and a restore reads a chain from its first page, so a
  page is read at least as often as any page after it. Redis samples its victims and
  keeps no order table of ours, so it may still evict a page before one after it
  (LMDB never does: ``tiers.l3.lmdb_chain``).
- Nothing waits long on a server that is down or slow: every call has a short socket
  timeout (``?socket_timeout=`` overrides it) and no client-side retries; after a connection
  failure the store answers "absent" and drops writes (counted) for a back-off that doubles
  up to ``_MAX_BACKOFF_S``, then tries again, so requests recompute instead of waiting.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from ..text import format_bytes, one_line
from .base import L3Store, ReadThrough, Snapshot, StoreError, StoreUnreachable
from .cipher import RecordCipher
from .record import FORMAT_VERSION, fingerprinted
from .redis_snapshot import BATCH_BYTES, HEAD, RedisSnapshot
from .redis_tables import RedisTables, counter_number
from .tables import DamageLog
from .writer import Batch, PendingPut

log = logging.getLogger(__name__)

T = TypeVar("T")
_TIMEOUT_S = 0.5  # connect and socket timeout, unless the URL sets them
_MAX_BACKOFF_S = 5.0
_warned: set[str] = set()  # servers already warned about their eviction settings (once a process)
# Delete a key only while it still holds the bad value a read saw: ARGV are how many leading
# bytes its fingerprint covers (``record.fingerprinted``) and their SHA-1.
_DELETE_IF_SAME = (
    "local head = redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1) "
    "if redis.sha1hex(head) == ARGV[2] then return redis.call('DEL', KEYS[1]) end return 0"
)


def connect(url: str) -> tuple[redis.Redis | RedisCluster, bytes]:
    """A client for ``url`` and the key prefix it names; ValueError on a malformed URL.
    The store's own, and a fleet router's (``kvtier route --l3-redis``) that asks which
    pages the shared L3 holds: the same options, so both name the same keys."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    prefix = query.pop("prefix", "kvtier:").encode()
    options: dict[str, Any] = {  # keyword arguments of either client
        "socket_timeout": float(query.pop("socket_timeout", _TIMEOUT_S)),
        "socket_connect_timeout": float(query.pop("socket_connect_timeout", _TIMEOUT_S)),
        "retry": Retry(NoBackoff(), 0),
    }
    if parts.scheme != "redis+cluster":
        plain = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
        return redis.Redis.from_url(plain, retry_on_error=[], **options), prefix
    auth, _, hosts = parts.netloc.rpartition("@")
    user, _, password = auth.partition(":")
    nodes = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        nodes.append(ClusterNode(name or "localhost", int(port)))
    return RedisCluster(
        startup_nodes=nodes, username=unquote(user) or None, password=unquote(password) or None, **options
    ), prefix


def page_name(prefix: bytes, key: bytes) -> bytes:
    """The Redis key of a page's record under ``prefix`` (see the module docstring)."""
    return prefix + b"p:" + key


def shown_url(url: str) -> str:
    """The URL without its password (for logs and stats)."""
    parts = urlsplit(url)
    auth, at, hosts = parts.netloc.rpartition("@")
    if ":" in auth:
        auth = auth.split(":", 1)[0] + ":***"
    return urlunsplit((parts.scheme, auth + at + hosts, parts.path, parts.query, ""))


def _total(reply: object, field: str) -> int:
    """A numeric INFO field, summed over a cluster's nodes (whose replies are per node)."""
    if isinstance(reply, dict) and field in reply:
        return int(reply[field])
    if isinstance(reply, dict):
        return sum(_total(node, field) for node in reply.values() if isinstance(node, dict))
    return 0


class RedisTier(L3Store):
    """L3 on a Redis / Valkey server or cluster (see the module docstring for what it
    keeps where and how it differs from LMDB). StoreError on open when the server cannot
    be reached, refuses the credentials, or holds another format version."""

    backend = "redis"
    tracks_use = False  # the server's LRU/LFU sees every GET itself

    def __init__(
        self,
        url: str,
        capacity_bytes: int | None = None,
        *,
        codec: str = "raw",
        zstd_level: int = 3,
        queue_pages: int = 64,
        readonly: bool = False,
        record_bytes: int | None = None,
        policy: str = "lru",
        cipher: RecordCipher | None = None,
    ) -> None:
        # policy and record_bytes are LMDB's: the server evicts by its own policy, by real size
        super().__init__(
            0, codec=codec, zstd_level=zstd_level, queue_pages=queue_pages, readonly=readonly, cipher=cipher
        )
        self.url = url
        try:
            self._client, self._prefix = connect(url)
        except (ValueError, redis.RedisError) as exc:
            raise StoreError(f"bad store URL {shown_url(url)}: {one_line(exc)}") from None
        self._cluster = isinstance(self._client, RedisCluster)
        self._all = {"target_nodes": RedisCluster.PRIMARIES} if self._cluster else {}  # server-wide numbers
        self._meta = self._prefix + b"meta"
        self.damage = DamageLog(self.location)
        self.tables = RedisTables(self._client, self._prefix, self._call, self.damage, readonly=readonly)
        self._down_until = 0.0
        self._backoff = 0.0
        self._evicted_at_open = 0
        try:
            self._open(capacity_bytes)
        except redis.RedisError as exc:
            self._client.close()
            down = isinstance(exc, (redis.ConnectionError, redis.TimeoutError))
            raise (StoreUnreachable if down else StoreError)(
                f"cannot use Redis store {self.location}: {one_line(exc)}"
            ) from None
        self._delete_if_same = self._client.register_script(_DELETE_IF_SAME)
        self._start()

    @property
    def location(self) -> str:
        return shown_url(self.url)

    def _open(self, asked: int | None) -> None:
        """Check the format version (a new store takes ours) and the server's cap."""
        if not self.readonly:
            self._client.hsetnx(self._meta, "format_version", FORMAT_VERSION)
        stored = self._client.hget(self._meta, "format_version")
        version = None if stored is None else counter_number(stored)
        if stored is not None and not isinstance(version, int):  # every record's own version is checked on read
            self.damage.report("meta value format_version", f"taken as {FORMAT_VERSION}")
            if not self.readonly:
                self._client.hset(self._meta, "format_version", FORMAT_VERSION)
        elif version is not None and version != FORMAT_VERSION:
            raise StoreError(
                f"store {self.location} has format version {version}, this kvtier reads version {FORMAT_VERSION}"
            )
        self._evicted_at_open = _total(self._client.info("stats", **self._all), "evicted_keys")
        try:
            config = self._client.config_get("maxmemory*")
        except redis.ResponseError:  # a managed server may refuse CONFIG: nothing to check
            return
        cap, policy = int(config.get("maxmemory") or 0), config.get("maxmemory-policy", "?")
        if asked is not None:
            log.info(
                "store %s: the Redis server's maxmemory (%s) is its cap; the %s asked for is ignored",
                self.location,
                format_bytes(cap) if cap else "none",
                format_bytes(asked),
            )
        if (not cap or policy == "noeviction") and urlsplit(self.url).netloc not in _warned:
            _warned.add(urlsplit(self.url).netloc)
            log.warning(
                "store %s: Redis has %s; set maxmemory and maxmemory-policy allkeys-lru so it "
                "evicts old pages instead of filling up (writes are then dropped)",
                self.location,
                "no maxmemory" if not cap else "maxmemory-policy noeviction",
            )

    # --- calls that must never fail or stall a request -----------------------------------

    def _call(self, what: str, call: Callable[[], T], default: T) -> T:
        """``call()``, or ``default`` when the server fails it (logged once per kind); a
        connection failure backs off (nothing is sent meanwhile), doubling to a cap."""
        if time.monotonic() < self._down_until:
            return default
        try:
            result = call()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._backoff = min(2 * self._backoff or 0.1, _MAX_BACKOFF_S)
            self._down_until = time.monotonic() + self._backoff
            self.failures.report(what, exc, f" (retrying in {self._backoff:.1f} s; meanwhile L3 misses)")
            return default
        except (redis.RedisError, ValueError) as exc:  # a refused command, a bad reply
            self.failures.report(what, exc)
            return default
        if self._backoff:
            log.warning("L3 Redis store %s reachable again", self.location)
            self._backoff = 0.0
        return result

    def reachable(self) -> bool:
        return time.monotonic() >= self._down_until

    def _page(self, key: bytes) -> bytes:
        return page_name(self._prefix, key)

    def mget(self, keys: list[bytes]) -> list[bytes | None]:
        """The stored values of ``keys`` in one round trip (None: absent or unreadable)."""
        names = [self._page(k) for k in keys]
        client = self._client
        mget = client.mget_nonatomic if isinstance(client, RedisCluster) else client.mget
        # redis-py types a reply for its sync and async clients alike (ResponseT); this client
        # is sync and sends bytes
        return self._call("read", lambda: cast("list[bytes | None]", mget(names)), [None] * len(keys))

    def ranges(self, spans: Sequence[tuple[bytes, int, int | None]], span_nbytes: int) -> list[bytes]:
        """Bytes ``[start, end)`` (``end`` None: to the end) of each key's value, b"" where
        absent, in pipelined rounds of about ``BATCH_BYTES`` (spans of at most ``span_nbytes``
        each); every b"" when the server fails them."""
        per = max(1, BATCH_BYTES // max(1, span_nbytes, HEAD))
        out: list[bytes] = []
        for first in range(0, len(spans), per):
            batch = spans[first : first + per]

            def ask(batch: Sequence[tuple[bytes, int, int | None]] = batch) -> list:
                pipe = self._client.pipeline(transaction=False)
                for key, start, end in batch:
                    pipe.getrange(self._page(key), start, -1 if end is None else end - 1)
                return pipe.execute()

            out += self._call("read", ask, [b""] * len(batch))
        return out

    def _exists(self, key: bytes) -> bool:
        return bool(self._call("lookup", lambda: self._client.exists(self._page(key)), 0))

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        found = self._exist_all(keys)
        return [bool(n) and not self.check.doomed(k) for k, n in zip(keys, found)]

    def _exist_all(self, keys: Sequence[bytes]) -> list:
        """``EXISTS`` of each key in one pipelined round trip (0s when none is sent or it fails)."""
        if not keys:
            return []

        def ask() -> list:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._page(key))
            return pipe.execute()

        return self._call("lookup", ask, [0] * len(keys))

    @contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        yield RedisSnapshot(self, self)

    def _fingerprint(self, value: memoryview | bytes) -> str:
        part = fingerprinted(value)
        return f"{len(part)}:{hashlib.sha1(part).hexdigest()}"

    def read_through(self, keys: Sequence[bytes]) -> ReadThrough:
        window = max(1, BATCH_BYTES // (1 << 20))
        parts = [
            ReadThrough.of([v for v in self.mget(list(keys[i : i + window])) if v is not None])
            for i in range(0, len(keys), window)
        ]
        return ReadThrough(sum(p.nbytes for p in parts), tuple(d for p in parts for d in p.digests))

    # --- writer thread -------------------------------------------------------------------

    def _commit(self, batch: Batch) -> None:
        for key, fingerprint in batch.deletes.items():
            length, sha1 = str(fingerprint).split(":")  # this backend's fingerprints (_fingerprint)
            self._call("delete", partial(self._delete_if_same, keys=[self._page(key)], args=[length, sha1]), 0)
        puts = self._absent(batch.puts)
        if not puts:
            return
        records = [(p.key, self.encoded(p)) for p in puts]
        parents = list(dict.fromkeys(p.parent for p in puts if p.parent is not None))

        def write() -> list:
            pipe = self._client.pipeline(transaction=False)
            for key, value in records:
                pipe.set(self._page(key), value, nx=True)
            for parent in parents:  # one key a command: a cluster routes each to its slot
                pipe.touch(self._page(parent))
            return pipe.execute(raise_on_error=False)[: len(records)]

        results = self._call("write", write, None)
        if results is None:
            self.count(writes_dropped=len(records))
            return
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:  # e.g. OOM under noeviction: those pages are not stored
            self.failures.report("write", errors[0], f" ({len(errors)} pages dropped)")
        self.count(inserts=sum(r is True for r in results), writes_dropped=len(errors))
        self.refresh()

    def _absent(self, puts: list[PendingPut]) -> list[PendingPut]:
        """The batch's pages the server lacks, asked in one pipelined ``EXISTS``, so a page
        already stored is never sent (``SET NX`` would refuse it, after its bytes crossed)."""
        found = self._exist_all([p.key for p in puts])  # unknown (0s): SET NX still keeps write-once
        return [p for p, n in zip(puts, found) if not n]

    def _close_backend(self) -> None:
        self._client.close()

    def refresh(self) -> None:
        def gauges() -> tuple[int, int, int, int]:
            memory, stats = self._client.info("memory", **self._all), self._client.info("stats", **self._all)
            return (
                _total(memory, "maxmemory"),
                _total(memory, "used_memory"),
                int(self._client.dbsize(**self._all)),
                _total(stats, "evicted_keys"),
            )

        numbers = self._call("meta read", gauges, None)
        if numbers is not None:
            with self._lock:
                cap, used, pages, evicted = numbers
                self._capacity = cap
                self.counters = replace(
                    self.counters,
                    capacity=cap,
                    bytes_used=used,
                    pages=pages,
                    evictions=max(0, evicted - self._evicted_at_open),
                )

    # --- management (caller threads) ----------------------------------------------------

    def clear(self, namespaces: set[bytes] | None = None) -> tuple[int, int]:
        """Delete every page under this store's prefix; (pages, bytes) removed. Records
        carry their namespace only inside the value, so clearing one namespace would
        read the whole store: refused."""
        if namespaces is not None:
            raise StoreError(
                f"store {self.location} is a Redis store: clearing one namespace is not "
                "supported (clear it all, or let maxmemory evict)"
            )
        self.flush()
        pages = nbytes = 0
        try:
            for keys in self._scan(self._prefix + b"p:*"):
                pipe = self._client.pipeline(transaction=False)
                for name in keys:
                    pipe.strlen(name)
                nbytes += sum(pipe.execute())
                self._client.delete(*keys)  # a cluster client splits it by slot
                pages += len(keys)
        except redis.RedisError as exc:
            raise StoreError(f"cannot clear {self.location}: {one_line(exc)}") from None
        self.refresh()
        return pages, nbytes

    def resize(self, capacity: int) -> int:
        raise StoreError(
            f"store {self.location} is a Redis store: its cap is the server's maxmemory "
            "(redis-cli CONFIG SET maxmemory ...)"
        )

    def _scan(self, pattern: bytes) -> Iterator[list[bytes]]:
        batch = []
        for name in self._client.scan_iter(match=pattern, count=1000):
            batch.append(name)
            if len(batch) == 1000:
                yield batch
                batch = []
        if batch:
            yield batch

    def drop_everything(self) -> None:
        """Delete every key under this store's prefix, meta and counters too (a scratch store)."""
        for keys in self._scan(self._prefix + b"*"):
            self._client.delete(*keys)


@contextmanager
def scratch_url(url: str) -> Iterator[str]:
    """``url`` under a fresh random prefix (the same server), emptied afterwards."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query["prefix"] = f"{query.get('prefix', 'kvtier:')}scratch-{secrets.token_hex(4)}:"
    scratch = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
    try:
        yield scratch
    finally:
        try:
            with RedisTier(scratch) as tier:
                tier.drop_everything()
        except StoreError as err:
            log.warning("scratch store %s not removed: %s", shown_url(scratch), err)
