"""Which pages the shared L3 holds, asked of the Redis / Valkey server the backends use
as ``--store`` (``kvtier route --l3-redis URL``): one pipelined ``EXISTS`` per request,
under the key names the store writes (``tiers.l3.redis_store.page_name``). A server
that does not answer in time holds nothing as far as placement goes (one warning until
it answers again): backends then recompute or restore what they find themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import redis

from kvtier.tiers.l3.redis_store import connect, page_name, shown_url
from kvtier.tiers.text import one_line

log = logging.getLogger(__name__)


class SharedL3:
    """The shared L3's residency. ``url`` as the backends' ``--store``; ValueError on a malformed one."""

    def __init__(self, url: str) -> None:
        self.location = shown_url(url)
        self._client, self._prefix = connect(url)
        self._down = False
        self.lookups = 0

    def _present(self, keys: Sequence[bytes]) -> set[bytes]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(page_name(self._prefix, key))
        try:
            found = pipe.execute()
        except redis.RedisError as err:
            if not self._down:
                log.warning(
                    "the shared L3 %s does not answer (%s): placed as if it held nothing", self.location, one_line(err)
                )
            self._down = True
            return set()
        if self._down:
            log.warning("the shared L3 %s answers again", self.location)
            self._down = False
        self.lookups += 1
        return {key for key, n in zip(keys, found) if n}

    async def present(self, keys: Sequence[bytes]) -> set[bytes]:
        """The keys of ``keys`` whose records the server holds (one round trip, in a worker thread)."""
        if not keys:
            return set()
        return await anyio.to_thread.run_sync(self._present, list(keys))

    def close(self) -> None:
        self._client.close()
