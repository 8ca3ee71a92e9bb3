"""A threaded soak of a serving engine (tests/engine/test_soak.py, bench/soak.py).

Submitter threads send a mix of identical prompts (single flight) and distinct ones;
some requests are cancelled (before admission or after their first tokens), some fail
by injection (a fault while admitting one, or while publishing its pages). Every
request must end, the survivors exactly as the model's own greedy loop says, with
nothing left pinned, queued or in flight, every tier within its cap, and every
engine structure the same size after each round (flat memory).
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.totals import EngineTotals

from .tiny import greedy

MARKERS = {"fail_admit": 1, "fail_publish": 2}  # a prompt starting with this token fails there
ACTIONS = ("keep", "keep", "keep", "cancel_early", "cancel_late", *MARKERS)


@dataclass
class SoakReport:
    outcomes: Counter = field(default_factory=Counter)  # (action, finish_reason) -> requests
    wrong_outputs: int = 0
    pins: int = 0
    over_cap: list[str] = field(default_factory=list)
    totals: EngineTotals = field(default_factory=EngineTotals)  # the engine's, at the end
    sizes: list[dict[str, int]] = field(default_factory=list)  # after each round
    memory: list[tuple[float, float]] = field(default_factory=list)  # (RSS, mlx active) MiB after each round

    @property
    def grown(self) -> dict[str, tuple[int, ...]]:
        """Structures whose size changed between rounds."""
        names = self.sizes[0] if self.sizes else {}
        return {n: tuple(s[n] for s in self.sizes) for n in names if len({s[n] for s in self.sizes}) > 1}


def inject_faults(engine: Engine) -> None:
    """Requests whose prompt starts with a marker (``MARKERS``) fail there."""
    admit, on_prefill = engine.admission.plan, engine.publisher.on_prefill

    def failing(real, marker):
        def work(request, *args):
            if request.prompt[0] == marker:
                raise RuntimeError(f"injected fault {marker}")
            return real(request, *args)

        return work

    engine.admission.plan = failing(admit, MARKERS["fail_admit"])
    engine.publisher.on_prefill = failing(on_prefill, MARKERS["fail_publish"])


def structure_sizes(engine: Engine) -> dict[str, int]:
    """Length of every container the engine and its parts hold (per-request state included)."""
    owners = {
        "engine": engine,
        "scheduler": engine.scheduler,
        "flights": engine.scheduler.flights,
        "window": engine.cached_tokens,
        "generator": engine.generator,
    }
    if engine.store is not None:
        owners.update(store=engine.store, l1=engine.store.l1, l2=engine.store.l2)
    sizes = {}
    for name, owner in owners.items():
        for attr, value in vars(owner).items():
            if _container(value):
                sizes[f"{name}.{attr}"] = _items(value)
    return sizes


def _container(value: object) -> bool:
    return hasattr(value, "__len__") and not isinstance(value, (str, bytes))


def _items(value) -> int:
    """Entries of a container; a dict of containers (an index) counts the entries inside them."""
    if isinstance(value, dict) and value and all(_container(v) for v in value.values()):
        return sum(len(v) for v in value.values())
    return len(value)


def rss_mib() -> float:
    """This process's resident memory (Linux; elsewhere 0)."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.exists() else []
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:")), 0.0)


def soak(
    engine: Engine, rounds: int = 2, per_round: int = 200, threads: int = 8, max_tokens: int = 4, seed: int = 0
) -> SoakReport:
    """Serve ``rounds * per_round`` requests from ``threads`` submitters (the engine is
    started here and stopped at the end); checks as in the module docstring."""
    rng = random.Random(seed)
    page = engine.config.page_size
    shared = [[32 + (s * 37 + i * 11) % 200 for i in range(3 * page + 5)] for s in range(4)]
    expected = {tuple(p): greedy(engine.loaded, p, max_tokens) for p in shared}  # distinct ones: not kept
    report = SoakReport()
    inject_faults(engine)
    engine.start()
    for _ in range(rounds):
        work = []
        for _ in range(per_round):
            action = rng.choice(ACTIONS)
            prompt = (
                list(rng.choice(shared))
                if rng.random() < 0.5
                else [32 + rng.randrange(200) for _ in range(rng.randrange(page // 2, 4 * page))]
            )
            if action in MARKERS:
                prompt[0] = MARKERS[action]
            work.append((action, prompt))
        for action, request, streamed in _serve_round(engine, work, threads, SamplingParams(max_tokens=max_tokens)):
            report.outcomes[(action, request.finish_reason)] += 1
            if request.finish_reason in ("length", "cancelled"):
                want = expected.get(tuple(request.prompt)) or greedy(engine.loaded, request.prompt, max_tokens)
                want = want[: len(request.output)] if request.finish_reason == "cancelled" else want
                report.wrong_outputs += request.output != want or streamed != request.output
        report.sizes.append(structure_sizes(engine))
        report.memory.append((rss_mib(), mx.get_active_memory() / 2**20))
    engine.stop()
    report.totals = engine.stats().totals
    if engine.store is not None:
        store = engine.store
        report.pins = len(store.accounts.view().pins)
        tiers = {"L1": store.l1.counters, "L2": store.l2.counters}
        tiers.update({"L3": store.disk.counters} if store.disk is not None else {})
        report.over_cap = [name for name, t in tiers.items() if t.bytes_used > t.capacity]
    return report


def _serve_round(engine: Engine, work: list, threads: int, params: SamplingParams) -> list:
    """Submit ``work`` ((action, prompt) pairs) from ``threads`` threads, each streaming
    its requests to the end (cancelling as told); (action, request, streamed tokens)."""
    ended, lock = [], threading.Lock()

    def submitter(share):
        for action, prompt in share:
            request = engine.submit(prompt, params)
            if action == "cancel_early":
                request.cancel()
            streamed = []
            for token in request.stream():
                streamed.append(token)
                if action == "cancel_late" and len(streamed) == 1:
                    request.cancel()
            with lock:
                ended.append((action, request, streamed))

    pool = [threading.Thread(target=submitter, args=(work[i::threads],), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(600)
    assert not any(t.is_alive() for t in pool), "a request never ended"
    return ended
