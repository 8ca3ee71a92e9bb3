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

from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams

from .tiny import greedy

FAIL_ADMIT, FAIL_PUBLISH = 1, 2  # a prompt starting with this token fails there
ACTIONS = ("keep", "keep", "keep", "cancel_early", "cancel_late", FAIL_ADMIT, FAIL_PUBLISH)


@dataclass
class SoakReport:
    outcomes: Counter = field(default_factory=Counter)  # (action, finish_reason) -> requests
    wrong_outputs: int = 0
    pins: int = 0
    over_cap: list[str] = field(default_factory=list)
    totals: dict = field(default_factory=dict)  # the engine's, at the end
    sizes: list[dict[str, int]] = field(default_factory=list)  # after each round

    @property
    def grown(self) -> dict[str, tuple[int, ...]]:
        """Structures whose size changed between rounds."""
        names = self.sizes[0] if self.sizes else {}
        return {n: tuple(s[n] for s in self.sizes) for n in names if len({s[n] for s in self.sizes}) > 1}


def inject_faults(engine: Engine) -> None:
    """Requests whose prompt starts with FAIL_ADMIT / FAIL_PUBLISH fail there."""
    admit, on_prefill = engine._admit, engine._on_prefill

    def failing(real, marker):
        def work(request, *args):
            if request.prompt[0] == marker:
                raise RuntimeError(f"injected fault {marker}")
            return real(request, *args)
        return work

    engine._admit = failing(admit, FAIL_ADMIT)
    engine._on_prefill = failing(on_prefill, FAIL_PUBLISH)


def structure_sizes(engine: Engine) -> dict[str, int]:
    """Length of every container the engine and its parts hold (per-request state included)."""
    owners = {"engine": engine, "scheduler": engine.scheduler, "flights": engine.scheduler.flights,
              "window": engine.cached_tokens, "generator": engine.generator}
    if engine.store is not None:
        owners.update(store=engine.store, l1=engine.store.l1, l2=engine.store.l2)
    sizes = {}
    for name, owner in owners.items():
        for attr, value in vars(owner).items():
            if hasattr(value, "__len__") and not isinstance(value, (str, bytes)):
                sizes[f"{name}.{attr}"] = len(value)
    return sizes


def soak(engine: Engine, rounds: int = 2, per_round: int = 200, threads: int = 8,
         max_tokens: int = 4, seed: int = 0) -> SoakReport:
    """Serve ``rounds * per_round`` requests from ``threads`` submitters (the engine is
    started here and stopped at the end); checks as in the module docstring."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens)
    page = engine.config.page_size
    shared = [[32 + (s * 37 + i * 11) % 200 for i in range(3 * page + 5)] for s in range(4)]
    expected: dict[tuple[int, ...], list[int]] = {}
    report = SoakReport()
    inject_faults(engine)
    engine.start()
    for _ in range(rounds):
        work = []
        for _ in range(per_round):
            action = rng.choice(ACTIONS)
            prompt = list(rng.choice(shared)) if rng.random() < 0.5 else \
                [32 + rng.randrange(200) for _ in range(rng.randrange(page // 2, 4 * page))]
            if action in (FAIL_ADMIT, FAIL_PUBLISH):
                prompt[0] = action
            work.append((action, prompt))
        ended: list = []
        lock = threading.Lock()

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
        for action, request, streamed in ended:
            report.outcomes[(str(action), request.finish_reason)] += 1
            key = tuple(request.prompt)
            if request.finish_reason in ("length", "cancelled"):
                if key not in expected:
                    expected[key] = greedy(engine.loaded, request.prompt, max_tokens)
                want = expected[key][: len(request.output)] if request.finish_reason == "cancelled" else expected[key]
                report.wrong_outputs += request.output != want or streamed != request.output
        report.sizes.append(structure_sizes(engine))
    engine.stop()
    report.totals = dict(engine.totals)
    if engine.store is not None:
        store = engine.store
        report.pins = len(store._pins)
        tiers = {"L1": store.l1.counters, "L2": store.l2.counters}
        tiers.update({"L3": store.disk.counters} if store.disk is not None else {})
        report.over_cap = [name for name, t in tiers.items() if t.bytes_used > t.capacity]
    return report
