"""Concurrent requests: single flight, streams from threads, pins under pressure, refresh, metrics."""

import threading
import time

import pytest

from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.flights import FlightCoordinator
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig

from .conftest import mlx_lm_greedy, text_prompt
from .tiny import greedy, tiny_model

PAGE = 64
GREEDY = SamplingParams(max_tokens=6)


def make_engine(loaded, l1_pages=64, l2_pages=64, **config) -> Engine:
    page_bytes = loaded.geometry(PAGE).nbytes
    store = StoreConfig(l1_bytes=l1_pages * page_bytes, l2_bytes=l2_pages * page_bytes, store_dir=None)
    return Engine(loaded, EngineConfig(page_size=PAGE, store=store, **config))


def computed(requests) -> int:
    return sum(r.sources()["recomputed"] for r in requests)


@pytest.mark.parametrize("policy", ["after-prefill", "at-completion"])
def test_identical_burst_computes_the_prompt_once(loaded, policy):
    prompt = text_prompt(loaded, 5 * PAGE + 20, seed=31)
    engine = make_engine(loaded, single_flight=policy)
    requests = engine.generate([prompt] * 4, GREEDY)
    expected = mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)
    assert all(r.output == expected for r in requests)
    assert computed(requests) <= len(prompt) + 3 * PAGE
    for follower in requests[1:]:
        assert follower.sources()["L1"] >= len(prompt) - PAGE - 1
    leader_done = requests[0].t_done
    if policy == "at-completion":
        assert all(f.t_first_token >= leader_done for f in requests[1:])
    else:
        assert all(f.t_first_token < leader_done for f in requests[1:])


def test_without_single_flight_a_burst_recomputes(loaded):
    prompt = text_prompt(loaded, 3 * PAGE + 7, seed=32)
    requests = make_engine(loaded, single_flight="off").generate([prompt] * 3, GREEDY)
    assert computed(requests) == 3 * len(prompt)


def test_followers_sample_with_their_own_settings(loaded):
    prompt = text_prompt(loaded, 2 * PAGE + 9, seed=33)
    engine = make_engine(loaded)
    short = engine.submit(prompt, SamplingParams(max_tokens=2))
    long = engine.submit(prompt, SamplingParams(max_tokens=9))
    engine.run()
    assert len(short.output) == 2 and len(long.output) == 9
    assert long.sources()["L1"] > 0


def test_threads_submit_and_stream(loaded):
    prompts = [text_prompt(loaded, n, seed=n) for n in (90, 170, 250)]
    engine = make_engine(loaded)
    engine.start()
    streamed = {}

    def client(i):
        request = engine.submit(prompts[i], GREEDY)
        streamed[i] = list(request.stream())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    engine.stop()
    for i, prompt in enumerate(prompts):
        assert streamed[i] == mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)


def test_pins_hold_under_pressure_and_outputs_stay_exact(loaded):
    """Many concurrent requests sharing prefixes, a 3-page L1 and a 4-page L2."""
    base = text_prompt(loaded, 3 * PAGE, seed=40)
    prompts = [base + text_prompt(loaded, 30 + 25 * i, seed=50 + i) for i in range(6)]
    engine = make_engine(loaded, l1_pages=3, l2_pages=4, max_running=4)
    engine.generate(prompts, GREEDY)  # warm: pages spill through the tiers
    requests = engine.generate(prompts + prompts[:3], GREEDY)
    for prompt, request in zip(prompts + prompts[:3], requests):
        assert request.output == mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)
    for tier in (engine.store.l1, engine.store.l2):
        assert tier.counters.bytes_used <= tier.counters.capacity
    assert not engine.store.accounts.view().pins, "every pin is released when its request ends"


def test_refresh_touches_waiting_pages_in_reverse_queue_order_without_pinning(loaded):
    prompts = [text_prompt(loaded, 2 * PAGE + 1, seed=60 + i) for i in range(3)]
    engine = make_engine(loaded, max_running=1)
    engine.generate(prompts, GREEDY)  # all pages in L1, prompt 2's most recent
    links = engine.store.stats().links
    blocker = engine.submit(text_prompt(loaded, 20, seed=69), GREEDY)
    waiting = [engine.submit(p, GREEDY) for p in prompts]  # queue: 0, 1, 2 behind the blocker
    engine.step()  # admits only the blocker; refreshes the three waiting ones
    lru_order = list(engine.store.l1.entries)
    tail = lru_order[-6:]
    assert tail == waiting[2].keys + waiting[1].keys + waiting[0].keys, "the head of the queue is touched last"
    assert not any(engine.store.keeping.pinned(k) for r in waiting for k in r.keys)
    assert engine.store.stats().links == links, "refresh loads nothing"
    engine.run()
    assert blocker.done


def test_hit_loss_between_enqueue_and_admission(loaded):
    victim = text_prompt(loaded, 4 * PAGE, seed=70)  # page-aligned: no partial page; 3 reusable pages
    engine = make_engine(loaded, l1_pages=4, max_running=1, refresh_window=0)
    engine.generate([victim], GREEDY)  # its 4 pages fill L1
    evicter = engine.submit(text_prompt(loaded, 4 * PAGE, seed=71), GREEDY)
    again = engine.submit(victim, GREEDY)
    engine.run()
    assert again.l1_tokens_at_enqueue == 3 * PAGE
    assert again.l1_tokens_at_admission == 0 and again.sources()["L2"] == 3 * PAGE
    assert engine.result(again)["l1_hit_loss"] == 3 * PAGE
    assert engine.stats().totals.l1_hit_loss_tokens == 3 * PAGE
    assert engine.stats().windowed.cached_tokens_per_s > 0
    assert evicter.done


class SerialCheckedFlights(FlightCoordinator):
    """A coordinator that counts calls made while another thread is inside it; each
    call lingers a little so that unlocked calls really do overlap."""

    def __init__(self, policy: str) -> None:
        super().__init__(policy)
        self._inside, self._owner, self.overlaps = threading.Lock(), None, 0


def _serial_checked(method):
    def call(self, *args):
        if self._owner == threading.get_ident():  # a nested call on the same thread
            return method(self, *args)
        if not self._inside.acquire(blocking=False):
            self.overlaps += 1
            self._inside.acquire()
        self._owner = threading.get_ident()
        try:
            time.sleep(0.0002)
            return method(self, *args)
        finally:
            self._owner = None
            self._inside.release()

    return call


for _name in ("join", "is_leader", "release", "prefilled", "terminate", "withdraw", "waiting"):
    setattr(SerialCheckedFlights, _name, _serial_checked(getattr(FlightCoordinator, _name)))


def test_many_submitters_never_overlap_inside_the_flight_coordinator():
    """8 threads submit identical and distinct prompts to a serving engine: every call
    into the coordinator is made under one lock, every request ends exactly."""
    loaded = tiny_model()
    engine = Engine(loaded, EngineConfig(page_size=16, store=StoreConfig(store_dir=None)))
    engine.scheduler.flights = flights = SerialCheckedFlights("after-prefill")
    shared = [[40 + (s * 13 + i * 5) % 150 for i in range(50)] for s in range(3)]
    prompts = [shared[i % 3] if i % 2 else [40 + (i * 17 + j) % 150 for j in range(30)] for i in range(96)]
    expected = {tuple(p): greedy(loaded, p, 4) for p in prompts}
    outputs = []
    engine.start()

    def submitter(share):
        for prompt in share:
            request = engine.submit(prompt, SamplingParams(max_tokens=4))
            outputs.append((prompt, list(request.stream()), request))

    threads = [threading.Thread(target=submitter, args=(prompts[i::8],), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream never ended"
    engine.close()
    assert flights.overlaps == 0
    assert len(outputs) == 96
    assert all(r.finish_reason == "length" and tokens == expected[tuple(p)] for p, tokens, r in outputs)
    view = flights.view()
    assert not (view.flights or view.key_of_leader or view.released)
