"""Where each request goes: one of three policies over the backends that answer.

- ``cache-aware`` (the default): ``costmodel.fleet.choose`` over every backend, each
  with what it would find of the prompt (``matched``: its L1/L2 pages and the pages in
  flight there, from its index, then the pages only the shared L3 holds, in prompt
  order up to the first neither has), its load and pending prompt tokens and its own
  profile. The pages of the chosen backend it does not hold are then in flight there
  until it publishes them or the request ends (``index``): prefix single flight across
  engines. A request's queue there does not count the prefill of the pages it will
  take from that flight (it waits for that work, it does not wait behind it twice).
- ``round-robin``: the next backend that answers, in ``--backend`` order.
- ``least-load``: the backend with the fewest requests running and waiting (then the
  fewest pending prompt tokens).

Ties (in least-load, and between backends cache-aware predicts alike, such as idle ones
for a prompt none holds) go to the first of the backends in an order that turns by one
each request, so an idle fleet is not all sent to the first ``--backend``.

Requests whose prompt the router cannot render (a body the backend will refuse) and
the requests that have no prompt go by least load. Keys are the implicit tenant's chain
(``tiers.page.key_chain`` from the namespace in the backend's hello): the router holds
no server secret, so for backends with API keys it finds the pages of the declared
shared prefixes (keyed from the namespace's digest for every tenant) and places the
rest by load (DESIGN §11).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvtier.costmodel.fleet import Candidate, choose
from kvtier.tiers.page import Namespace, Source, key_chain, reusable_pages

from .backend import Backend
from .l3 import SharedL3

log = logging.getLogger(__name__)


class Policy(str, Enum):
    CACHE_AWARE = "cache-aware"
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"


@dataclass
class Ticket:
    """One attempt of one request on one backend; :meth:`end` exactly once (idempotent)."""

    backend: Backend
    reason: str
    tokens: int = 0  # prompt tokens the backend is expected to compute (its pending work)
    flown: list[bytes] = field(default_factory=list)
    _answering: bool = False
    _ended: bool = False
    _handle: int = field(init=False, default=-1)

    def __post_init__(self) -> None:
        self._handle = self.backend.send(self.tokens)

    def answering(self) -> None:
        """The backend's answer started: its own load reports count the prompt from here
        (``Backend.answered``: after a few more of them)."""
        if not self._answering:
            self._answering = True
            self.backend.answered(self._handle)

    def end(self) -> None:
        """The attempt is over: served if the backend's answer started (then its pages stay
        in flight until published or a grace period), failed if not."""
        if self._ended:
            return
        served = self._answering
        self.answering()
        self._ended = True
        self.backend.done(self._handle)
        self.backend.index.land(self.flown, served)


class Placer:
    """The policy over the backends; counts of what it chose, by backend and by reason."""

    def __init__(
        self, backends: Sequence[Backend], policy: Policy, max_imbalance: int, l3: SharedL3 | None = None
    ) -> None:
        self.backends, self.policy, self.max_imbalance, self.l3 = list(backends), policy, max_imbalance, l3
        self._turn = itertools.count()
        self._ties = itertools.count()
        self.routed: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()

    async def place(self, tokens: list[int] | None, exclude: Collection[str] = ()) -> Ticket | None:
        """A ticket on the backend chosen for a prompt of ``tokens`` (None: no prompt, or one
        the router cannot render) among those that answer and are not in ``exclude``; None
        when no backend is left."""
        up = [b for b in self.backends if b.healthy and b.name not in exclude]
        if not up:
            return None
        turn = next(self._ties) % len(up)
        up = up[turn:] + up[:turn]  # the first of equals turns
        if self.policy is Policy.ROUND_ROBIN:
            ticket = Ticket(self._round_robin(up), "round-robin")
        elif self.policy is Policy.LEAST_LOAD or tokens is None or not any(b.keyed for b in up):
            ticket = Ticket(self._least_loaded(up), "least-load")
        else:
            ticket = await self._cache_aware(up, tokens)
        self.routed[ticket.backend.name] += 1
        self.reasons[ticket.reason] += 1
        log.info("request to %s (%s)", ticket.backend.name, ticket.reason)
        return ticket

    def _round_robin(self, up: list[Backend]) -> Backend:
        while True:
            backend = self.backends[next(self._turn) % len(self.backends)]
            if backend in up:
                return backend

    def _least_loaded(self, up: list[Backend]) -> Backend:
        return min(up, key=lambda b: (b.load, b.pending_tokens))

    async def _cache_aware(self, up: list[Backend], tokens: list[int]) -> Ticket:
        chains: dict[Namespace, list[bytes]] = {}
        for backend in up:
            namespace = backend.namespace
            if backend.keyed and namespace is not None and namespace not in chains:
                reusable = reusable_pages(len(tokens), namespace.page_size)
                chains[namespace] = [bytes(k) for k in key_chain(namespace, tokens).keys[:reusable]]
        shared = await self.l3.present(list({k for keys in chains.values() for k in keys})) if self.l3 else set()
        keyed = next(b for b in up if b.keyed)
        page_size, page_bytes = keyed.page_size, keyed.page_bytes
        candidates, keys_of = [], {}
        for backend in up:
            keys = chains.get(backend.namespace, []) if backend.keyed and backend.namespace is not None else []
            matched: list[Source] = []
            flying = 0
            for key in keys:
                source = backend.index.where(key) or (Source.L3 if key in shared else None)
                if source is None:
                    break
                matched.append(source)
                flying += backend.index.in_flight(key)
            pending = max(0, backend.pending_tokens - flying * page_size)
            candidates.append(Candidate(backend.name, tuple(matched), pending, backend.load, backend.profile))
            keys_of[backend.name] = keys
        placement = choose(candidates, len(tokens), page_size, page_bytes, self.max_imbalance)
        chosen = next(b for b in up if b.name == placement.backend)
        reused = len(next(c.matched for c in candidates if c.name == chosen.name)) * page_size
        ticket = Ticket(chosen, placement.reason.value, len(tokens) - reused)
        ticket.flown = chosen.index.fly(keys_of[chosen.name])
        return ticket

    def view(self) -> dict:
        return {"policy": self.policy.value, "routed": dict(self.routed), "reasons": dict(self.reasons)}
