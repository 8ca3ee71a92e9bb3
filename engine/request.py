"""A request's life: prompt, sampling settings, restored prefix, outputs and labels."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtier.costmodel.plan import RestorePlan
from kvtier.tiers.hierarchy import RestoredPrefix
from kvtier.tiers.l3_reads import AheadRead
from kvtier.tiers.page import IMPLICIT_ROOT, ChainRoot, PageKey, Source

# How a request ended: mlx-lm's two (an EOS or stop token, max_tokens), and ours.
CANCELLED, ERROR = "cancelled", "error"


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # sample among the k likeliest tokens only (0: all); applied before top_p
    seed: int | None = None  # its own random stream (temperature > 0)
    # mlx-lm's logits processors: added to the logits of these token ids, and subtracted
    # from those of tokens among the sequence's last 20 (once, or once per occurrence)
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # keep each output token's log-probability and this many top alternatives
    # Constrained decoding (a tool_choice): the output starts with these tokens, and never
    # completes one of these token sequences (each banned at its last token).
    forced: list[int] = field(default_factory=list)
    banned: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability (after logit_bias and penalties, before temperature
    and top_p: mlx-lm's) and the most likely tokens at its position, best first."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)  # a request is itself: compared and hashed by identity
class Request:
    """One prompt in the engine.

    ``sources`` always sums to ``len(prompt)``: restored pages count by the tier
    they came from, the shared start of an L1 page after them as L1, every other
    token (the last one always) as recomputed (pages computed while others load, in
    an overlapped plan, too).

    Every request ends exactly once, with a ``finish_reason`` ("stop", "length",
    "cancelled" or "error", then with ``error`` saying why), its pins released and
    its stream ended.
    """

    rid: int
    prompt: list[int]
    params: SamplingParams
    page_size: int
    keys: list[PageKey]  # keys of the reusable full pages
    root: ChainRoot = IMPLICIT_ROOT  # where its key chain starts (its caller's, DESIGN §9a)
    parents: list[bytes] = field(default_factory=list)  # the key before each of them, and after the last
    uid: int | None = None  # BatchGenerator's id once admitted
    plan: RestorePlan | None = None
    restored: RestoredPrefix | None = None
    pinned: list[PageKey] = field(default_factory=list)  # store pins held, released when it ends
    prefix_tokens: int = 0  # tokens in the cache handed to mlx-lm: restored, or computed while loading
    partial_tokens: int = 0  # of them, the shared start of an L1 page after the restored pages
    published: int = 0  # leading pages known to be in the store
    ended_in: list[PageKey] = field(
        default_factory=list
    )  # its sequence's keys at the end: full pages, then the partial page
    tail_tokens: int = 0  # tokens of that partial page, kept in L1 (0: none): what a tool-wait hold pins too
    snapshot_spacing: int = 0  # a hybrid model's: its state is kept every this many pages (costmodel.spacing)
    snapshot_pages: list[int] = field(default_factory=list)  # and after these pages of its prompt
    matched_tokens: int = 0  # the longest stored match at admission: where the prompt left the cache
    shared_end: int = 0  # a hybrid model's: where it leaves an L1 page midway (0: it does not); state kept there
    prefilled: int = 0  # tokens mlx-lm has prefilled after the restored prefix
    resumed: int = 0  # of them, those prefilled before its last insertion (``Engine._snapshot_at``)
    l1_tokens_at_enqueue: int = 0  # prompt tokens in L1 when submitted
    l1_tokens_at_admission: int = 0  # ... and when admitted (pages may move meanwhile)
    waited_tokens: int = 0  # prompt tokens it waited for another request to compute (prefix flight)
    wait_s: float = 0.0  # seconds held waiting for them
    wait_deadline: float | None = None  # perf_counter after which it never waits again
    t_held: float | None = None  # when it was last held
    l3_read: AheadRead | None = None  # its L3 pages read off the step loop (``engine.l3_wait``)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if params.logprobs is set
    finish_reason: str | None = None
    error: str | None = None  # one line, when finish_reason is "error"
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float | None = None  # when it joined the batch
    t_first_token: float | None = None
    t_done: float | None = None
    abandoned: bool = False  # its stream was ended before the request (``abandon``)
    _tokens: queue.Queue = field(default_factory=queue.Queue, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def stream(self) -> Iterator[int]:
        """Output tokens as they are generated (from any thread), until the request ends."""
        while (token := self._tokens.get()) is not None:
            yield token

    def cancel(self) -> None:
        """Ask the engine to end this request at its next step (from any thread); a
        request that already ended is left as it is."""
        self._cancel.set()

    def abandon(self) -> None:
        """``cancel``, and end its stream now rather than when the engine ends the request
        (from any thread): for a server shutting down, whose clients must hear the end
        within the drain timeout although one engine step (a prefill chunk) can take
        longer. Tokens generated after this are not streamed; the engine still ends the
        request once, at its next step."""
        self.abandoned = True
        self.cancel()
        self._tokens.put(None)

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel`` was asked for (the request may not have ended yet)."""
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def sources(self) -> dict[str, int]:
        counts = {s.value: 0 for s in Source}
        for source in self.restored.sources if self.restored else []:
            counts[source.value] += self.page_size
        counts[Source.L1.value] += self.partial_tokens
        counts[Source.RECOMPUTED.value] = len(self.prompt) - sum(counts.values())
        return counts
