"""How close an eviction policy can come to the infinite-cache bound on a Mooncake trace,
and what it would have to know: one cache of the tiers' pages, replayed without a store.

The cache holds L1 + L2 + L3 pages (``(l1 + l2 + l3) // (kv_bytes_per_token *
page_size)``, as ``kvtier replay`` gives Belady) and evicts leaf-first: the page of
lowest priority among those no cached page follows, so a page never leaves while a
page after it in some prompt is held. A request reuses its leading reusable pages
(``(input_length - 1) // page_size``) up to the first one missing, as the project's
bound counts them (``costmodel.bounds``, which gives the bound and Belady here). Rows:

- ``lru``; ``gdsf``: GreedyDual-Frequency, every page costing the same (the clock plus
  the page's uses; each eviction raises the clock to the victim's priority).
- ``belady``: evicts the page used again farthest in the future.
- Oracles that protect some pages (least recently used first among the unprotected,
  then among the protected): a page that will ever be used again (not when); a page
  used again within T seconds.
- A predictor of "ever used again" per request (one draw decides all its pages, as a
  predictor of whether the conversation continues would): it protects a reused page
  with chance ``recall`` and leaves a page never reused unprotected with chance
  ``specificity``; the mean over seeds 0 and 1.

If knowing whether a page comes back, and not when, is enough to reach the bound, the
points an online policy loses are a prediction problem: the predictor rows say how
good that prediction must be.

    python bench/eviction_oracles.py TRACE.jsonl [--requests 6000] [--sweep l2-bytes=8GiB,32GiB,128GiB]
        [--page-size 512] [--kv-bytes-per-token 12288] [--l1-bytes 2GiB] [--l3-bytes 64GiB] [--json]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import kvtier  # noqa: F401  (loads OpenBLAS before mlx, which the size flags' parser imports)

# isort: split
from kvtier.costmodel.bounds import belady, infinite_cache
from kvtier.costmodel.trace import BLOCK_TOKENS, TraceError, TraceRequest, page_names, read_trace
from kvtier.engine.cli.args import l2_sweep, parse_size, positive_int

WITHIN_S = (60, 300, 600)  # seconds: the "used again within T" oracles
# (recall, specificity): about 0.4 at 0.8 is what a classifier over the trace's request features
# reached; about 0.8 at 0.9 is what 5 points under the bound at L2 8 GiB takes
PREDICTORS = ((0.4, 0.8), (0.6, 0.8), (0.8, 0.8), (0.8, 0.9), (0.9, 0.9), (0.9, 0.95))
SEEDS = (0, 1)

Score = Callable[[int, int, int, float], float]  # (request, position, page, clock) -> priority; lowest leaves first


@dataclass(frozen=True)
class Pages:
    """The trace's reusable pages as dense ids, and when each is used next."""

    chains: list[list[int]]  # per request, its reusable pages in prompt order
    arrival_s: list[float]
    next_use: list[list[int]]  # per request and page: the next request that uses it (len(chains): none)
    prompt_tokens: int
    page_size: int

    @classmethod
    def of(cls, trace: list[TraceRequest], page_size: int) -> Pages:
        ids: dict[tuple[int, int], int] = {}
        chains = [[ids.setdefault(name, len(ids)) for name in page_names(r, page_size)] for r in trace]
        next_use: list[list[int]] = [[] for _ in chains]
        upcoming: dict[int, int] = {}
        for index in range(len(chains) - 1, -1, -1):
            next_use[index] = [upcoming.get(page, len(chains)) for page in chains[index]]
            upcoming.update((page, index) for page in chains[index])
        prompt_tokens = sum(r.input_length for r in trace)
        return cls(chains, [r.arrival_s for r in trace], next_use, prompt_tokens, page_size)


class LeafFirstCache:
    """One cache of ``capacity`` pages; a page's priority is set at each use, and the
    cache evicts the lowest among its leaves (the deepest first on a tie)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.priority: dict[int, float] = {}
        self.parent: dict[int, int] = {}  # -1: the first page of a prompt
        self.children: dict[int, int] = {}  # cached pages that follow it
        self.depth: dict[int, int] = {}
        self.heap: list[tuple[float, int, int, int]] = []  # (priority, -depth, order, page); stale ones skipped
        self.order = itertools.count()
        self.clock = 0.0  # the highest priority evicted so far

    def held(self, chain: list[int]) -> int:
        """The leading pages of ``chain`` the cache holds (the reuse)."""
        return next((i for i, page in enumerate(chain) if page not in self.priority), len(chain))

    def use(self, chain: list[int], priorities: list[float]) -> None:
        """A request used ``chain``: its pages are held with these priorities, then the
        cache evicts down to its capacity."""
        for i, (page, value) in enumerate(zip(chain, priorities)):
            if page not in self.priority:
                parent = chain[i - 1] if i else -1
                self.parent[page], self.children[page], self.depth[page] = parent, 0, i
                if parent >= 0:
                    self.children[parent] += 1
            self.priority[page] = value
            if not self.children[page]:
                self._push(page)
        while len(self.priority) > self.capacity:
            value, _, _, page = heapq.heappop(self.heap)
            if self.priority.get(page) != value or self.children[page]:
                continue  # stale, or no longer a leaf (pushed again when it is one)
            del self.priority[page], self.children[page], self.depth[page]
            self.clock = max(self.clock, value)
            parent = self.parent.pop(page)
            if parent in self.priority:
                self.children[parent] -= 1
                if not self.children[parent]:
                    self._push(parent)

    def _push(self, page: int) -> None:
        heapq.heappush(self.heap, (self.priority[page], -self.depth[page], next(self.order), page))


def replay(pages: Pages, capacity: int, score: Score) -> float:
    """The reused share of all prompt tokens for one cache under ``score``."""
    cache, hits = LeafFirstCache(capacity), 0
    for index, chain in enumerate(pages.chains):
        hits += cache.held(chain)
        cache.use(chain, [score(index, i, page, cache.clock) for i, page in enumerate(chain)])
    return hits * pages.page_size / max(pages.prompt_tokens, 1)


def protecting(pages: Pages, protect: Callable[[int, int], bool]) -> Score:
    """Least recently used first, among the unprotected pages before the protected."""
    offset = len(pages.chains)
    return lambda index, i, page, clock: index + offset * protect(index, i)


def gdsf() -> Score:
    uses: Counter[int] = Counter()

    def score(index: int, i: int, page: int, clock: float) -> float:
        uses[page] += 1
        return clock + uses[page]

    return score


def predictor(pages: Pages, recall: float, specificity: float, seed: int) -> Score:
    """Protects a request's pages that are used again with chance ``recall`` and those
    never used again with chance ``1 - specificity``, one draw a request."""
    rng = random.Random(seed)
    draw = [rng.random() if chain else 0.0 for chain in pages.chains]
    never = len(pages.chains)

    def protect(index: int, i: int) -> bool:
        return draw[index] < recall if pages.next_use[index][i] < never else draw[index] >= specificity

    return protecting(pages, protect)


def rows(pages: Pages, trace: list[TraceRequest], capacity: int) -> dict[str, float]:
    """Every row's reused share at one capacity."""
    never, t = len(pages.chains), pages.arrival_s

    def ever(index: int, i: int) -> bool:
        return pages.next_use[index][i] < never

    def within(seconds: float) -> Callable[[int, int], bool]:
        return lambda index, i: (n := pages.next_use[index][i]) < never and t[n] - t[index] <= seconds

    out = {
        "lru": replay(pages, capacity, protecting(pages, lambda index, i: False)),
        "gdsf (clock + uses)": replay(pages, capacity, gdsf()),
        "belady": sum(belady(trace, pages.page_size, capacity)) / max(pages.prompt_tokens, 1),
        "ever-reused oracle": replay(pages, capacity, protecting(pages, ever)),
    }
    for seconds in WITHIN_S:
        out[f"reused-within-{seconds}s oracle"] = replay(pages, capacity, protecting(pages, within(seconds)))
    for recall, spec in PREDICTORS:
        runs = [replay(pages, capacity, predictor(pages, recall, spec, seed)) for seed in SEEDS]
        out[f"predictor recall {recall:.2f} spec {spec:.2f}"] = sum(runs) / len(runs)
    return out


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage
        self.exit(2, f"{self.prog}: error: {message}\n")


def gib(size: int) -> str:
    return f"{size / (1 << 30):g}GiB"


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a Mooncake trace (JSON lines)")
    parser.add_argument("--requests", type=positive_int, default=6000, help="the trace's first N requests")
    parser.add_argument("--page-size", type=positive_int, default=512, help="tokens a page (divides 512)")
    parser.add_argument("--kv-bytes-per-token", type=positive_int, default=12288)
    parser.add_argument("--l1-bytes", type=parse_size, default=parse_size("2GiB"))
    parser.add_argument("--l3-bytes", type=parse_size, default=parse_size("64GiB"))
    parser.add_argument("--sweep", type=l2_sweep, default=l2_sweep("l2-bytes=8GiB,32GiB,128GiB"), help="L2 sizes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if BLOCK_TOKENS % args.page_size:
        parser.error(f"--page-size {args.page_size} does not divide {BLOCK_TOKENS}")
    page_bytes = args.kv_bytes_per_token * args.page_size
    capacities = [(args.l1_bytes + l2 + args.l3_bytes) // page_bytes for l2 in args.sweep]
    if min(capacities) < 1:
        parser.error(f"L1 + L2 + L3 hold no {page_bytes}-byte page")
    try:
        trace = read_trace(args.trace)[: args.requests]
    except TraceError as exc:
        parser.error(str(exc))
    pages = Pages.of(trace, args.page_size)
    bound = sum(infinite_cache(trace, args.page_size)) / max(pages.prompt_tokens, 1)
    caches = [
        {"l2_bytes": l2, "capacity_pages": c, "reused": rows(pages, trace, c)} for l2, c in zip(args.sweep, capacities)
    ]
    if args.json:
        report = {"requests": len(trace), "prompt_tokens": pages.prompt_tokens, "page_size": args.page_size}
        report |= {"page_bytes": page_bytes, "l1_bytes": args.l1_bytes, "l3_bytes": args.l3_bytes}
        print(json.dumps(report | {"infinite_cache": bound, "seeds": list(SEEDS), "caches": caches}, indent=1))
        return
    print(
        f"{len(trace)} requests, {pages.prompt_tokens} prompt tokens, page {args.page_size} tokens = "
        f"{page_bytes / (1 << 20):.1f} MiB; one cache of L1 {gib(args.l1_bytes)} + L2 + L3 {gib(args.l3_bytes)}"
    )
    print(f"infinite cache: reused {bound:.2%}\n")
    print(f"{'reused % (points under the bound)':36}" + "".join(f"{'L2 ' + gib(c['l2_bytes']):>15}" for c in caches))
    print(f"{'cache pages':36}" + "".join(f"{c['capacity_pages']:>15}" for c in caches))
    for name in caches[0]["reused"]:
        cells = (c["reused"][name] for c in caches)
        print(f"{name:36}" + "".join(f"{100 * v:8.2f} ({100 * (bound - v):4.1f})" for v in cells))
    print(f"predictor: one draw a request, mean of seeds {', '.join(map(str, SEEDS))}")


if __name__ == "__main__":
    main()
