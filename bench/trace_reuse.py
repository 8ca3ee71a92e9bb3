"""Where an online policy's reuse goes missing on a Mooncake trace, and what the trace
offers to predict it: no store, one pass over the trace's pages (each request's leading
``(input_length - 1) // 512`` blocks, as the replay keys them).

- One cache of ``--cache-pages`` pages (by default L1 2 GiB + L2 8 GiB + L3 64 GiB of
  6 MiB pages) in least-recently-used order, beside the infinite-cache bound: the reuses
  it finds and misses, by the page's age (seconds since its last use) at the reuse and
  by how often it had been used before.
- Predictors of a page's next use that an online policy could read: its uses so far
  (the chance of one more), its age without a reuse (the chance of a reuse later), and
  the prompt length of the request that published it.
- The last as a policy: one GreedyDual-Frequency cache of the same pages (``cost`` with
  every page costing the same, page by page), whose pages of a short prompt
  (``SHORT`` tokens at most) count ``--prior`` extra uses, against none.

    python bench/trace_reuse.py TRACE.jsonl [--requests 6000] [--cache-pages 12629]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
from collections import Counter, OrderedDict, defaultdict
from pathlib import Path

from kvtier.costmodel.trace import BLOCK_TOKENS, TraceRequest, read_trace

SHORT = 8000  # prompt tokens: the publishers whose pages are reused most (the predictors above)
AGES = (60, 120, 300, 600, 1200)  # seconds: the buckets of a reuse's age
LENGTHS = (4000, 8000, 16000, 32000, 64000)  # prompt tokens: the buckets of a publisher's length


def bucket(value: float, edges: tuple[int, ...]) -> str:
    """The first edge ``value`` is at most (``>last`` above them all)."""
    return next((f"<={edge}" for edge in edges if value <= edge), f">{edges[-1]}")


def pages_of(request: TraceRequest) -> tuple[int, ...]:
    return request.hash_ids[: (request.input_length - 1) // BLOCK_TOKENS]


def lru_misses(trace: list[TraceRequest], capacity: int) -> None:
    """The reuses one LRU cache of ``capacity`` pages finds and misses (the bound's, per
    request: its leading pages some earlier request used)."""
    cache: OrderedDict[int, None] = OrderedDict()
    last: dict[int, float] = {}
    uses: Counter[int] = Counter()
    found, missed, found_uses, missed_uses = Counter(), Counter(), Counter(), Counter()
    bound = hits = 0
    for request in trace:
        pages = pages_of(request)
        known = next((i for i, page in enumerate(pages) if page not in last), len(pages))
        held = next((i for i, page in enumerate(pages) if page not in cache), len(pages))
        bound, hits = bound + known, hits + held
        for i, page in enumerate(pages[:known]):
            ages, by_uses = (found, found_uses) if i < held else (missed, missed_uses)
            ages[bucket(request.arrival_s - last[page], AGES)] += 1
            by_uses[min(uses[page], 4)] += 1
        for page in pages:
            cache[page] = None
            cache.move_to_end(page)
            last[page], uses[page] = request.arrival_s, uses[page] + 1
        while len(cache) > capacity:
            cache.popitem(last=False)
    print(f"one LRU cache of {capacity} pages: {hits} of the bound's {bound} reused pages ({hits / max(bound, 1):.1%})")
    for name, counts in (("found", found), ("missed", missed)):
        print(f"  {name} by age (s): " + ", ".join(f"{k} {counts[k]}" for k in sorted(counts, key=_edge)))
    for name, counts in (("found", found_uses), ("missed", missed_uses)):
        print(f"  {name} by uses before (4: 4 or more): " + ", ".join(f"{k} {counts[k]}" for k in sorted(counts)))


def _edge(label: str) -> float:
    return float(label.lstrip("<=>")) + (0.5 if label.startswith(">") else 0.0)


def predictors(trace: list[TraceRequest]) -> None:
    """The chance of a page's next use given its uses, its age without reuse, and its
    publisher's prompt length."""
    times: dict[int, list[float]] = defaultdict(list)
    length: dict[int, int] = {}
    for request in trace:
        for page in pages_of(request):
            length.setdefault(page, request.input_length)
            times[page].append(request.arrival_s)
    used = Counter(len(t) for t in times.values())
    chances = []
    for k in range(1, 6):
        at_least = sum(n for uses, n in used.items() if uses >= k)
        more = sum(n for uses, n in used.items() if uses > k)
        chances.append(f"{k}: {more / max(at_least, 1):.0%}")
    print("chance of one more use, by uses so far: " + ", ".join(chances))
    end = trace[-1].arrival_s - max(AGES)  # pages published early enough to be seen at every age
    early = [t for t in times.values() if t[0] <= end]
    later = []
    for age in AGES:
        unused = [t for t in early if len(t) == 1 or t[1] - t[0] > age]
        later.append(f"{age} s: {sum(len(t) > 1 for t in unused) / max(len(unused), 1):.1%}")
    print("chance of a reuse, for a page not reused within: " + ", ".join(later))
    by_length: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for page, t in times.items():
        row = by_length[bucket(length[page], LENGTHS)]
        row[0], row[1] = row[0] + 1, row[1] + (len(t) > 1)
    rows = sorted(by_length.items(), key=lambda kv: _edge(kv[0]))
    print("reused, by the publisher's prompt tokens: " + ", ".join(f"{k} {r / n:.0%} of {n}" for k, (n, r) in rows))


def greedy_dual(trace: list[TraceRequest], capacity: int, prior: float) -> float:
    """The share of the bound's reused pages one GreedyDual-Frequency cache of ``capacity``
    pages finds, a page's priority the clock plus its uses (plus ``prior`` for a short
    prompt's pages); each victim's priority becomes the clock."""
    clock, priority, uses, heap, order = 0.0, {}, Counter(), [], itertools.count()
    seen: set[int] = set()
    bound = hits = 0
    for request in trace:
        pages = pages_of(request)
        bound += next((i for i, page in enumerate(pages) if page not in seen), len(pages))
        hits += next((i for i, page in enumerate(pages) if page not in priority), len(pages))
        seen.update(pages)
        extra = prior if request.input_length <= SHORT else 0.0
        for page in pages:
            uses[page] += 1
            priority[page] = clock + uses[page] + extra
            heapq.heappush(heap, (priority[page], next(order), page))
        while len(priority) > capacity:
            value, _, page = heapq.heappop(heap)
            if priority.get(page) == value:
                clock = value
                del priority[page]
    return hits / max(bound, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--requests", type=int, default=6000, help="the trace's first N requests")
    parser.add_argument("--cache-pages", type=int, default=(2 + 8 + 64) * 1024 // 6)
    parser.add_argument("--prior", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    args = parser.parse_args()
    trace = read_trace(args.trace)[: args.requests]
    lru_misses(trace, args.cache_pages)
    predictors(trace)
    found = [f"{prior:g}: {greedy_dual(trace, args.cache_pages, prior):.1%}" for prior in [0.0, *args.prior]]
    print("one GreedyDual cache, extra uses of a short prompt's pages -> share of the bound found: " + ", ".join(found))


if __name__ == "__main__":
    main()
