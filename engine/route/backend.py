"""One backend as the router sees it: whether it answers (health checks), what its
event stream said last (its namespace, profile, load and pages), and the router's own
requests there.

The stream's contract (``GET /v1/kvtier/events``, DESIGN §11): every event carries
``seq`` (+1 per event on one connection, 0 for the ``hello`` that always comes first)
and ``epoch`` (one per server start). Anything else than the next ``seq`` of the same
epoch is a gap: the index is dropped and the stream reconnects, and the new ``hello``
rebuilds it (:class:`Resync`).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from kvtier.costmodel.profile import Profile
from kvtier.tiers.page import Namespace, Source

from .index import TIERS, PageIndex

log = logging.getLogger(__name__)

# Load reports that must come after a request's answer started before the backend's own
# count is trusted to hold its prompt: a streamed answer starts (its first chunk) as soon
# as the backend takes the request, before its prefill, and the first report to arrive
# after that may have left the backend before the request came in (another connection).
REPORTS_TO_COVER = 2


class Resync(Exception):
    """The stream cannot be followed from here (a gap, another epoch, a bad event):
    reconnect and start from a fresh hello."""


@dataclass
class Load:
    """What a backend reported as its work: requests running and waiting, and the prompt
    tokens admitted or waiting but not prefilled yet."""

    running: int = 0
    waiting: int = 0
    pending_tokens: int = 0

    @classmethod
    def of(cls, data: dict) -> Load:
        return cls(int(data["running"]), int(data["waiting"]), int(data["pending_tokens"]))


@dataclass
class Sent:
    """One request the router sent to a backend: the prompt tokens it expects computed
    there, and how many load reports had come when its answer started (None: not yet)."""

    tokens: int
    answered_at: int | None = None


class Backend:
    """A backend's state. ``healthy``: its last health checks answered. ``synced``: its
    stream's hello came and every event since followed it. The router's own count of
    requests there (``outstanding``) and of their prompt tokens not known to be
    prefilled (``sent_tokens``) bound its load from below between two load events."""

    def __init__(self, url: str, fingerprint: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.name = self.url
        self.fingerprint = fingerprint  # the router's tokenizer's model; a backend of another is not keyed
        self.healthy = False
        self.failures = 0  # health checks failed in a row
        self.synced = False
        self.epoch: str | None = None
        self.seq = -1
        self.namespace: Namespace | None = None
        self.page_size = 0
        self.page_bytes = 0
        self.profile = Profile.defaults()
        self.reported = Load()
        self.index = PageIndex()
        self._sent: dict[int, Sent] = {}
        self._handles = itertools.count()
        self.load_reports = 0  # load events and hellos received (each carries a load)
        self.resyncs = 0  # hellos after the first

    def send(self, tokens: int) -> int:
        """A request the router sends here, expected to compute ``tokens`` prompt tokens;
        its handle for :meth:`answered` and :meth:`done`."""
        handle = next(self._handles)
        self._sent[handle] = Sent(tokens)
        return handle

    def answered(self, handle: int) -> None:
        """The request's answer started: its prompt stays in ``sent_tokens`` until
        ``REPORTS_TO_COVER`` load reports more have come (the backend's count has it)."""
        sent = self._sent.get(handle)
        if sent is not None and sent.answered_at is None:
            sent.answered_at = self.load_reports

    def done(self, handle: int) -> None:
        """The request is over here (answered or failed)."""
        self._sent.pop(handle, None)

    @property
    def outstanding(self) -> int:
        """The router's requests here that have not ended."""
        return len(self._sent)

    @property
    def sent_tokens(self) -> int:
        """The prompt tokens of the router's requests here that the backend's reports may
        not count yet: not answered, or answered fewer than ``REPORTS_TO_COVER`` reports ago."""
        covered = self.load_reports - REPORTS_TO_COVER
        return sum(s.tokens for s in self._sent.values() if s.answered_at is None or s.answered_at > covered)

    @property
    def load(self) -> int:
        """Requests running and waiting there: the backend's report, or the router's own
        count when that is more (a burst the backend has not reported yet)."""
        return max(self.reported.running + self.reported.waiting, self.outstanding)

    @property
    def pending_tokens(self) -> int:
        return max(self.reported.pending_tokens, self.sent_tokens)

    @property
    def keyed(self) -> bool:
        """Whether the router can name this backend's pages (a hello from a model whose
        fingerprint is the router's tokenizer's)."""
        return self.synced and self.namespace is not None

    def apply(self, event: str, data: dict) -> None:
        """One event of the stream; Resync when it does not follow the last one."""
        if event == "hello":
            self._hello(data)
            return
        if not self.synced or data.get("epoch") != self.epoch or data.get("seq") != self.seq + 1:
            raise Resync(f"{self.name}: event {event} seq {data.get('seq')} after seq {self.seq} of epoch {self.epoch}")
        self.seq += 1
        try:
            if event == "pages":
                tier = Source(data["tier"])
                if tier not in TIERS:
                    raise ValueError(f"tier {tier.value}")
                self.index.apply(tier, map(bytes.fromhex, data["stored"]), map(bytes.fromhex, data["evicted"]))
            elif event == "load":
                self.reported = Load.of(data)
                self.load_reports += 1
            elif event == "profile":
                self.profile = Profile.from_dict(data["profile"])
        except (KeyError, TypeError, ValueError) as err:
            raise Resync(f"{self.name}: bad {event} event ({err!r})") from None

    def _hello(self, data: dict) -> None:
        if data.get("seq") != 0:
            raise Resync(f"{self.name}: hello with seq {data.get('seq')}")
        try:
            served = Namespace(**data["namespace"])
            pages: dict[Source, list[bytes]] = {
                tier: [bytes.fromhex(k) for k in data["pages"].get(tier.value, [])] for tier in TIERS
            }
            profile, load = Profile.from_dict(data["profile"]), Load.of(data["load"])
            page_size, page_bytes = int(data["page_size"]), int(data["page_bytes"])
        except (KeyError, TypeError, ValueError) as err:
            raise Resync(f"{self.name}: bad hello ({err!r})") from None
        namespace: Namespace | None = served
        if self.fingerprint is not None and served.model_fingerprint != self.fingerprint:
            log.warning("%s serves another model than the router's tokenizer: routed by load only", self.name)
            namespace, pages = None, {}
        if self.epoch is not None:
            self.resyncs += 1
        self.epoch, self.seq, self.synced = str(data.get("epoch")), 0, True
        self.namespace, self.page_size, self.page_bytes = namespace, page_size, page_bytes
        self.profile, self.reported = profile, load
        self.load_reports += 1
        self.index.reset(pages)

    def lost(self) -> None:
        """The stream ended or broke: what it said of the pages no longer holds."""
        self.synced = False
        self.index.clear()

    def view(self) -> dict:
        """The router's view of it (``GET /v1/kvtier/route``): no prompt, no key."""
        return {
            "url": self.url,
            "healthy": self.healthy,
            "synced": self.synced,
            "epoch": self.epoch,
            "resyncs": self.resyncs,
            "pages": self.index.sizes(),
            "load": {
                "running": self.reported.running,
                "waiting": self.reported.waiting,
                "pending_tokens": self.reported.pending_tokens,
                "outstanding": self.outstanding,
            },
            "profile_calibrated": self.profile.calibrated,
        }
