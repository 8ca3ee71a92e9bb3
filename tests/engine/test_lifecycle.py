"""A long-running engine: start/stop/close, cancellation, per-request failure, EOS.

The tiny model (tests/engine/tiny.py) keeps these fast; its own greedy loop is the oracle.
"""

import threading

import pytest

from kvtier.costmodel.models import ComputeModel, LinkModel
from kvtier.costmodel.plan import Profile
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import Source

from .tiny import greedy, tiny_model

PAGE = 16
GREEDY = SamplingParams(max_tokens=6)
LONG = SamplingParams(max_tokens=200)
ENDLESS = SamplingParams(max_tokens=30_000)  # ends only by cancellation in these tests (within the context)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def text_prompt(loaded, n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i * 7) % 200 + 32 for i in range(n)]


def mlx_lm_greedy(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    return greedy(loaded, prompt, max_tokens)


def make_engine(loaded, store_dir=None, **config) -> Engine:
    store = StoreConfig(l1_bytes=1 << 30, l2_bytes=1 << 30, l3_bytes=1 << 30, store_dir=store_dir)
    return Engine(loaded, EngineConfig(page_size=PAGE, store=store, **config))


def drained(request, timeout: float = 120) -> list[int]:
    """The request's stream read on another thread; fails (instead of hanging) if it never ends."""
    tokens, reader = [], threading.Thread(target=lambda: tokens.extend(request.stream()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert not reader.is_alive(), f"the stream of request {request.rid} never ended"
    return tokens


def assert_clean(engine: Engine) -> None:
    """Nothing of any request is left: no pins, no queue, no flight, nothing running."""
    assert not engine.store.accounts.view().pins
    view = engine.view()
    assert not view.running and not view.pending
    flights = view.flights
    assert not (flights.flights or flights.key_of_leader or flights.released)


# -- lifecycle ---------------------------------------------------------------------


def test_close_while_serving_finishes_the_requests_then_stops(loaded, tmp_path):
    engine = make_engine(loaded, tmp_path)
    engine.start()
    assert engine.view().serving
    requests = [engine.submit(text_prompt(loaded, 150, seed=i), SamplingParams(max_tokens=30)) for i in range(3)]
    engine.close()
    assert not engine.view().serving
    assert [r.finish_reason for r in requests] == ["length"] * 3
    assert [len(drained(r)) for r in requests] == [30] * 3
    with pytest.raises(RuntimeError, match="stopped"):
        engine.submit(text_prompt(loaded, 10))
    with pytest.raises(RuntimeError, match="serves once"):
        engine.start()
    engine.close()  # a second close does nothing


def test_a_second_start_is_refused(loaded):
    engine = make_engine(loaded)
    engine.start()
    with pytest.raises(RuntimeError, match="serves once"):
        engine.start()
    engine.close()


def test_engine_and_store_are_context_managers(loaded, tmp_path):
    prompt = text_prompt(loaded, 3 * PAGE + 1, seed=2)
    with make_engine(loaded, tmp_path / "engine") as engine:
        engine.start()
        request = engine.submit(prompt, GREEDY)
    assert request.finish_reason == "length" and not engine.store.accounts.view().l3_open
    geometry = loaded.geometry(PAGE)
    with TieredStore(geometry, engine.namespace, StoreConfig(store_dir=tmp_path / "engine")) as store:
        assert store.locate(request.keys, prompt) == [Source.L3] * 3  # flushed on exit
    assert not store.accounts.view().l3_open


def test_leaving_the_engine_on_an_exception_cancels_its_requests(loaded):
    with pytest.raises(KeyboardInterrupt):
        with make_engine(loaded) as engine:
            engine.start()
            request = engine.submit(text_prompt(loaded, 30), ENDLESS)
            raise KeyboardInterrupt
    assert request.finish_reason == "cancelled" and not engine.view().serving


@pytest.mark.parametrize("serving", [False, True])
def test_stop_with_cancel_ends_everything_at_the_next_step(loaded, serving):
    engine = make_engine(loaded, max_running=1)
    requests = [engine.submit(text_prompt(loaded, 40, seed=i), ENDLESS) for i in range(3)]
    if serving:
        engine.start()
        while not requests[0].output:  # the first is running, the others wait
            threading.Event().wait(0.001)
    else:
        engine.step()
    engine.stop(cancel=True)
    assert [r.finish_reason for r in requests] == ["cancelled"] * 3
    assert [len(drained(r)) < ENDLESS.max_tokens for r in requests] == [True] * 3
    assert_clean(engine)


# -- cancellation --------------------------------------------------------------------


def test_cancel_a_running_request_ends_it_at_the_next_step(loaded):
    prompt = text_prompt(loaded, 3 * PAGE + 5, seed=3)
    engine = make_engine(loaded)
    engine.generate([prompt], GREEDY)  # its pages are in L1: the next run pins them
    request, other = engine.submit(prompt, LONG), engine.submit(text_prompt(loaded, 70, seed=4), GREEDY)
    while len(request.output) < 3:
        engine.step()
    assert engine.store.accounts.view().pins
    request.cancel()
    engine.step()
    assert request.finish_reason == "cancelled" and request.uid not in engine.view().running
    assert len(request.output) < LONG.max_tokens
    assert not engine.store.accounts.view().pins
    engine.run()
    assert other.output == mlx_lm_greedy(loaded, other.prompt, GREEDY.max_tokens)
    assert drained(request) == request.output
    assert engine.stats().totals.cancelled == 1 and engine.stats().totals.requests == 2
    assert_clean(engine)


def test_cancel_a_waiting_request(loaded):
    engine = make_engine(loaded, max_running=1)
    first, waiting = (
        engine.submit(text_prompt(loaded, 50, seed=5), GREEDY),
        engine.submit(text_prompt(loaded, 60), GREEDY),
    )
    engine.step()
    waiting.cancel()
    engine.run()
    assert first.finish_reason == "length" and waiting.finish_reason == "cancelled"
    assert waiting.uid is None and waiting.output == [] and drained(waiting) == []
    assert_clean(engine)


@pytest.mark.parametrize("policy", ["after-prefill", "at-completion"])
def test_cancel_a_held_follower_or_the_leader_of_a_flight(loaded, policy):
    """A held follower leaves its flight; a cancelled leader hands the flight to its
    first follower, which computes the prompt for the rest. Outputs stay exact."""
    prompt = text_prompt(loaded, 3 * PAGE + 9, seed=6)
    expected = mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)
    engine = make_engine(loaded, single_flight=policy)
    leader, a, b, c = (engine.submit(prompt, GREEDY) for _ in range(4))
    b.cancel()
    leader.cancel()
    engine.run()
    assert (leader.finish_reason, b.finish_reason) == ("cancelled", "cancelled")
    assert a.output == c.output == expected
    # c follows a's prefill (prefix) or its end (at-completion), when a's last partial page is in L1 too
    assert a.sources()["recomputed"] == len(prompt)
    assert c.sources()["L1"] == (len(prompt) - 1 if policy == "at-completion" else 3 * PAGE)
    assert_clean(engine)


# -- per-request failure -------------------------------------------------------------


def poisoned(engine: Engine, method: str, poison: list[int]) -> None:
    """Make ``engine.method`` (a dotted path: ``publisher.on_prefill``) raise whenever it
    works for the request whose prompt is ``poison``."""
    *parts, name = method.split(".")
    for part in parts:
        engine = getattr(engine, part)
    real = getattr(engine, name)

    def work(request, *args):
        if request.prompt == poison:
            raise RuntimeError("injected fault")
        return real(request, *args)

    setattr(engine, name, work)


@pytest.mark.parametrize("method", ["admission.plan", "publisher.on_prefill", "_on_token"])
def test_a_failing_request_ends_alone_with_an_error(loaded, tmp_path, method):
    """A fault while admitting, publishing or collecting one request ends that request
    ("error", stream ended, pins released, counted); the others are served exactly."""
    prompts = [text_prompt(loaded, 2 * PAGE + 30, seed=10 + i) for i in range(3)]
    engine = make_engine(loaded, tmp_path)
    engine.generate(prompts[:2], GREEDY)  # prompt 1's pages are stored: its restore pins them
    poisoned(engine, method, prompts[1])
    engine.start()
    requests = [engine.submit(p, GREEDY) for p in prompts]
    streams = [drained(r) for r in requests]
    engine.stop()
    bad = requests[1]
    assert bad.finish_reason == "error" and bad.error == "RuntimeError: injected fault"
    assert engine.result(bad)["error"] == bad.error
    for i in (0, 2):
        assert requests[i].finish_reason == "length"
        assert streams[i] == requests[i].output == mlx_lm_greedy(loaded, prompts[i], GREEDY.max_tokens)
    assert engine.stats().totals.errors == 1
    assert_clean(engine)
    engine.close()


def test_a_fault_after_the_restore_releases_its_pins(loaded):
    """The restore pinned the pages, then handing them to mlx-lm failed."""
    prompt = text_prompt(loaded, 4 * PAGE + 3, seed=20)
    engine = make_engine(loaded)
    engine.generate([prompt], GREEDY)
    insert = engine.generator.insert
    engine.generator.insert = lambda *a, **k: (_ for _ in ()).throw(MemoryError("injected"))
    (request,) = engine.generate([prompt], GREEDY)
    assert request.finish_reason == "error" and request.sources()["L1"] == len(prompt) - 1  # with the partial page
    assert not engine.store.accounts.view().pins
    engine.generator.insert = insert
    (again,) = engine.generate([prompt], GREEDY)
    assert again.output == mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)
    assert_clean(engine)


def test_a_request_failing_mid_prefill_publishes_only_whole_correct_pages(loaded):
    """Publication failed after the first prefill step: what is stored is whole and
    exact (a later run restores it and matches mlx_lm), and the request ends."""
    prompt = text_prompt(loaded, 6 * PAGE + 1, seed=21)
    engine = make_engine(loaded, prefill_step_size=2 * PAGE)
    publish, calls = engine.publisher.publish, []

    def second_fails(request, caches, ready):
        calls.append(ready)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        publish(request, caches, ready)

    engine.publisher.publish = second_fails
    (request,) = engine.generate([prompt], GREEDY)
    assert request.finish_reason == "error" and engine.store.l1.counters.pages == 2
    engine.publisher.publish = publish
    (again,) = engine.generate([prompt], GREEDY)
    assert again.sources()["L1"] == 2 * PAGE
    assert again.output == mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)
    assert_clean(engine)


def test_a_failing_batch_step_fails_its_requests_and_the_engine_goes_on(loaded):
    engine = make_engine(loaded)
    engine.start()
    real, failed = engine.generator.next, []

    def fails_once():
        if not failed:
            failed.append(True)
            raise RuntimeError("injected fault")
        return real()

    engine.generator.next = fails_once
    lost = engine.submit(text_prompt(loaded, 80, seed=22), GREEDY)
    assert drained(lost) == [] and lost.finish_reason == "error"
    later = engine.submit(text_prompt(loaded, 90, seed=23), GREEDY)
    assert drained(later) == mlx_lm_greedy(loaded, later.prompt, GREEDY.max_tokens)
    engine.close()
    assert_clean(engine)


# -- EOS -------------------------------------------------------------------------------


def test_an_eos_token_stops_generation_and_is_not_output(loaded):
    """The default model never emits its EOS: here the EOS is a token the model does emit."""
    prompt = text_prompt(loaded, 40, seed=24)
    expected = mlx_lm_greedy(loaded, prompt, 12)
    eos = expected[4]
    stops_at = expected.index(eos)
    engine = Engine(tiny_model(eos_token_ids=(eos,)), EngineConfig(page_size=PAGE, offload=False))
    (request,) = engine.generate([prompt], SamplingParams(max_tokens=12))
    assert request.finish_reason == "stop"
    assert request.output == expected[:stops_at]


def test_a_fault_while_computing_beside_an_overlapped_restore_releases_every_pin(loaded, tmp_path):
    """An overlapped plan pins the loaded pages on the loader thread while the model
    computes the front; the compute fails: every pin (the loader's too) is released."""
    prompt = text_prompt(loaded, 12 * PAGE + 7, seed=30)
    with make_engine(loaded, tmp_path) as first:
        first.generate([prompt], GREEDY)
    per_page = 0.05
    page_bytes = loaded.geometry(PAGE).nbytes
    store = StoreConfig(
        l1_bytes=1 << 30,
        l2_bytes=1 << 30,
        l3_bytes=1 << 30,
        store_dir=tmp_path,
        throttle={"L3": 1.5 * page_bytes / per_page},
    )
    engine = Engine(loaded, EngineConfig(page_size=PAGE, store=store))
    engine.profile = Profile(
        {**Profile.defaults().links, "L3->L1": LinkModel.of(0.0, 1 << 40)}, ComputeModel([0.0, per_page / PAGE, 0.0])
    )
    engine.prefix_caches.prefill = lambda cache, tokens: (_ for _ in ()).throw(RuntimeError("injected fault"))
    (request,) = engine.generate([prompt], GREEDY)
    assert request.plan.overlap_pages > 0 and request.finish_reason == "error"
    assert engine.store.links["L3->L1"].pages > 0, "the loader restored pages"
    assert_clean(engine)
    engine.close()
