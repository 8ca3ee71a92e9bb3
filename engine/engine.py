"""The engine: mlx-lm's BatchGenerator with prefixes restored from, and published to, the store.

A request's path (DESIGN §2): tokens -> page keys -> locate -> restore the
stored prefix into a fresh mlx-lm KV cache -> ``BatchGenerator.insert`` with that
cache and the remaining tokens -> after every step, publish the pages that became
full -> decode -> finish -> release pins. With prefix single flight, a request whose
next pages a running request is computing may first wait for them (``engine.admission``,
priced by ``costmodel.plan.plan_wait``; the bookkeeping is ``engine.prefix_flights``).

Every request ends exactly once (``_end``): finished, cancelled (``Request.cancel``),
or failed ("error": an exception while admitting, publishing or collecting it fails
that request only; one inside mlx-lm's batch step fails the requests in the batch).
Ending takes it out of the batch, releases its pins, withdraws it from single
flight, counts it and ends its stream. All mlx work runs on the thread that steps
(the serving thread after ``start``); other threads only submit, stream and cancel.

This module is the step loop and the lifecycle; each part it drives has one job:
``admission`` (plan, or hold for a prefix in flight), ``prefix_cache`` (the cache a
request starts from), ``publisher`` (pages into the store), ``refinement`` (the cost
model learns online), ``totals`` (what is counted), ``limits`` (what a model takes).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import numpy as np
from mlx_lm.generate import BatchGenerator

from kvtier.costmodel.plan import Profile
from kvtier.costmodel.spacing import choose_spacing, prefill_segments, snapshot_pages
from kvtier.tiers.hierarchy import TieredStore
from kvtier.tiers.l3_reads import nothing_read
from kvtier.tiers.page import IMPLICIT_ROOT, ChainRoot, key_chain, reusable_pages
from kvtier.tiers.quant import namespace_codecs

from .admission import Admission, l1_tokens
from .config import EngineConfig as EngineConfig  # re-exported: where callers have always found it
from .flights import FlightCoordinator, FlightsView
from .l3_wait import L3Wait
from .limits import InputError as InputError  # re-exported likewise
from .limits import check_prompt
from .metrics import RateWindow
from .models.load import LoadedModel
from .prefix_cache import PrefixCaches
from .prefix_flights import PrefixFlightsView
from .publisher import Publisher
from .refinement import observe_links, observe_prefill, refit_after_first_tokens
from .request import CANCELLED, ERROR, Request, SamplingParams
from .sampling import logits_processors, sampler, token_logprob
from .scheduler import Scheduler
from .stats import EngineStats, LastRun, Window
from .totals import EngineTotals, request_record

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineView:
    """The engine's state at one moment, read-only: what tests and a debugger look at."""

    running: Mapping[int, Request]  # in the batch, by BatchGenerator uid
    pending: int  # not admitted yet, held ones included
    serving: bool  # a serving thread (``start``) is alive
    flights: FlightsView  # exact-input single flight
    prefix: PrefixFlightsView  # prefix single flight


class Engine:
    """Generates for many requests at once, reusing stored KV pages."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.geometry = loaded.geometry(self.config.page_size)
        cipher = self.config.store.cipher if self.config.offload else None
        store = self.config.store
        codecs = namespace_codecs(store.codec, store.l2_codec) if self.config.offload else ""
        self.namespace = loaded.namespace(self.geometry, self.config.cache_salt, cipher.name if cipher else "", codecs)
        self.root = self.namespace.digest()  # the key "before" a sequence's first page
        self.store = (
            TieredStore(self.geometry, self.namespace, replace(self.config.store, policy=self.config.policy))
            if self.config.offload
            else None
        )
        self.generator = BatchGenerator(
            loaded.model,
            stop_tokens=[[t] for t in loaded.tokenizer.eos_token_ids],
            prefill_step_size=self.config.prefill_step_size,
        )
        self.profile = self._load_profile()
        if self.store is not None:  # each page weighed by its recompute at its depth, as the fit stands
            self.store.page_cost.by_index = self.profile.compute.page_costs(self.config.page_size)
        policy = self.config.single_flight if self.store is not None else "off"
        self._prefix_flight = policy == "prefix"  # exact inputs are a prefix case: no exact flights then
        flights = FlightCoordinator("off" if self._prefix_flight else policy)
        self.scheduler = Scheduler(flights, self.config.max_running, self.config.refresh_window)
        self.cached_tokens = RateWindow(self.config.window_s)
        self.totals = EngineTotals()
        self._running: dict[int, Request] = {}
        self._rids = itertools.count()
        self._serving: threading.Thread | None = None
        self._stop = threading.Event()
        self._cancel_all = False  # set by stop(cancel=True); the stepping thread cancels
        self._closed = False
        # the parts that work on the store (none without one)
        self.admission: Admission | None = None
        self.publisher: Publisher | None = None
        self.prefix_caches: PrefixCaches | None = None
        self.l3_wait: L3Wait | None = None
        if self.store is not None:
            self.l3_wait = L3Wait(self.store, self.scheduler, self.config.page_size, self.config.join_wait_s)
            self.admission = Admission(
                self.store,
                self.scheduler,
                self.config,
                self.geometry,
                self._running,
                self._prefix_flight,
                self._snapshot_at,
            )
            self.publisher = Publisher(
                self.store, self.scheduler, self.generator, self.config, self.namespace, self.totals
            )
            self.prefix_caches = PrefixCaches(self.store, loaded.model, self.config, self.publisher)

    def _load_profile(self) -> Profile:
        """The calibrated cost model of this machine and model, else conservative defaults."""
        key = self.loaded.profile_key(self.geometry, self.namespace.codecs)
        saved = Profile.stored(self.store.accounts.get_meta(key), key) if self.store is not None else None
        if saved is not None:
            return saved
        log.info("no calibrated cost model for this machine and model: using defaults (run `kvtier calibrate`)")
        return Profile.defaults()

    # -- submission ------------------------------------------------------------

    def submit(
        self, prompt: Sequence[int] | str, params: SamplingParams | None = None, root: ChainRoot = IMPLICIT_ROOT
    ) -> Request:
        """Queue a prompt (text is tokenized as ``tokenizer.encode`` does); thread-safe.
        Refused (RuntimeError) once the engine is stopping or closed. ``root``: where its
        key chain starts (a server's tenant; DESIGN §9a): everything keyed from it (its
        pages, partial pages, snapshots, single flight) is found only by requests of the
        same root, but for the pages of a declared shared prefix."""
        tokens = self.loaded.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = params or SamplingParams()
        check_prompt(self.loaded, tokens, params)
        reusable = reusable_pages(len(tokens), self.config.page_size)
        chain = key_chain(self.namespace, tokens, root)
        keys = chain.keys[:reusable]
        parents = chain.parents[: reusable + 1]
        request = Request(next(self._rids), tokens, params, self.config.page_size, keys, root, parents)
        if self.store:
            resident = self.store.locate(keys, tokens, nothing_read())  # L3 not asked on the caller's thread
            request.l1_tokens_at_enqueue = l1_tokens(resident, self.config.page_size)
        own = self.root if root.own is None else root.own  # one flight per input and caller
        flight_key = hashlib.blake2b(np.asarray(tokens, "<u4").tobytes(), digest_size=16, key=own).digest()
        with self.scheduler.arrived:  # the lock under which the serving loop decides to exit
            if self._stop.is_set():
                raise RuntimeError("the engine is stopped: submit before stop() or close()")
            self.scheduler.add(request, flight_key)
        return request

    # -- the step loop ---------------------------------------------------------

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while self.scheduler.pending() or self._running:
            self.step()

    def generate(self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | None = None) -> list[Request]:
        """Submit prompts as one burst and run them to completion."""
        requests = [self.submit(p, params) for p in prompts]
        self.run()
        return requests

    def start(self) -> None:
        """Serve in a background thread: ``submit`` from anywhere, read ``Request.stream``.
        An engine serves once: a second ``start`` is refused."""
        if self._serving is not None or self._stop.is_set():
            raise RuntimeError("the engine was already started (or stopped): an Engine serves once")
        self._serving = threading.Thread(target=self._serve, name="kvtier-engine", daemon=True)
        self._serving.start()
        if self.store is not None:  # a serving process may be killed: its counters reach the store as it runs
            self.store.accounts.checkpoint_every(
                self.config.counters_every_s, lambda: {"engine": self.totals.to_dict()}
            )

    def stop(self, cancel: bool = False) -> None:
        """Stop taking requests and end those already queued or running: finished (or,
        with ``cancel``, cancelled at the next step); then join the serving thread.
        Without one, the requests are run here."""
        with self.scheduler.arrived:
            self._cancel_all = self._cancel_all or cancel
            self._stop.set()
            self.scheduler.arrived.notify_all()
        if self._serving is not None:
            self._serving.join()
        self.run()  # drained already by the serving thread, if there was one

    def _serve(self) -> None:
        while True:
            with self.scheduler.arrived:
                while not (self.scheduler.pending() or self._running or self._stop.is_set()):
                    self.scheduler.arrived.wait()
                if not (self.scheduler.pending() or self._running):
                    return  # stopped and drained
            try:
                self.step()
            except Exception as exc:  # a fault outside any one request: fail those in the batch, go on
                self._fail_batch(exc)

    def step(self) -> None:
        """End cancelled requests, refresh and admit waiting ones, run one BatchGenerator
        step, publish and collect."""
        if self._cancel_all:
            for request in [*self.scheduler.queued(), *self._running.values()]:
                request.cancel()
        for request in self.scheduler.cancelled():
            self._end(request, CANCELLED)
        self.scheduler.expire(time.perf_counter())
        if self.store is not None:
            assert self.l3_wait is not None  # built with the store
            self.l3_wait.poll(idle=not self._running)
            for request in self.scheduler.refresh_candidates():
                self.store.keeping.touch(request.keys)
        while admitted := self.scheduler.admit(len(self._running)):  # again while some were held
            for request in admitted:
                self._guarded(request, self._admit)
        for request in [r for r in self._running.values() if r.cancelled]:
            self._end(request, CANCELLED)
        if not self._running:
            refit_after_first_tokens(self.profile, self._running)
            if self.l3_wait is not None:
                self.l3_wait.wait()  # requests whose L3 pages are being read
            return  # everyone left is a held follower (their leader is done) or parked
        t0 = time.perf_counter()
        try:
            prompt_responses, generation_responses = self.generator.next()
        except Exception as exc:
            self._fail_batch(exc)
            return
        observe_prefill(self.profile, self._running, prompt_responses, generation_responses, time.perf_counter() - t0)
        for response in generation_responses:  # the tokens to their readers before the store's work
            if (running := self._running.get(response.uid)) is not None:
                self._guarded(running, self._deliver, response)
        if self.publisher is not None:
            for response in prompt_responses:
                if (running := self._running.get(response.uid)) is not None:  # not failed in this step
                    self._guarded(running, self.publisher.on_prefill, response)
        for response in generation_responses:
            if (running := self._running.get(response.uid)) is not None:
                self._guarded(running, self._on_token, response)
        refit_after_first_tokens(self.profile, self._running)

    def _fail_batch(self, exc: Exception) -> None:
        """A fault in the batch as a whole (its state is unknown): every request in it fails."""
        log.error("engine step failed: %s", _one_line(exc), exc_info=log.isEnabledFor(logging.DEBUG))
        for request in list(self._running.values()):
            self._end(request, ERROR, exc)

    def _guarded(self, request: Request, work: Callable[..., None], *args: object) -> None:
        """``work(request, *args)``; an exception ends that request with an error."""
        try:
            work(request, *args)
        except Exception as exc:
            log.warning("request %d failed: %s", request.rid, _one_line(exc), exc_info=log.isEnabledFor(logging.DEBUG))
            self._end(request, ERROR, exc)

    def _admit(self, request: Request) -> None:
        """Plan, bring in the chosen prefix, hand it to mlx-lm; or hold the request to wait
        for pages another request is computing."""
        cache: list | None = None
        if request.t_held is not None:
            request.wait_s += time.perf_counter() - request.t_held
            request.t_held = None
        if self.store is not None:
            assert self.admission is not None and self.prefix_caches is not None and self.l3_wait is not None
            admission, profile = self.admission, self.profile
            if self.l3_wait.park(
                request, profile, lambda resident: admission.worth_reading(request, resident, profile)
            ):
                return  # back once its L3 pages are read, or at its deadline
            t0 = time.perf_counter()
            matched = self.admission.plan(request, self.profile)
            if matched is None:
                return  # held
            links_before = self.store.stats().links
            try:
                cache = self.prefix_caches.build(request, len(matched))
            finally:
                self.l3_wait.ended(request)
            assert request.restored is not None  # set by build, if only to nothing restored
            observe_links(self.profile, self.config.store.throttle, links_before, self.store.stats().links)
            request.published = request.prefix_tokens // self.config.page_size
            restored = request.restored.num_pages * self.config.page_size + request.partial_tokens
            request.matched_tokens = max(len(matched) * self.config.page_size, restored)
            self.cached_tokens.add(request.restored.num_pages * self.config.page_size + request.partial_tokens)
            self.totals.store_seconds += time.perf_counter() - t0
        request.t_admit = time.perf_counter()
        if self.geometry.snapshot_nbytes and self.store is not None:  # prefill chunks end where states are kept
            request.snapshot_spacing = self.config.snapshot_spacing or choose_spacing(
                self.profile, self.config.page_size, self.geometry.snapshot_nbytes, len(request.prompt)
            )
            request.snapshot_pages = snapshot_pages(
                len(request.prompt),
                self.config.page_size,
                request.snapshot_spacing,
                request.matched_tokens // self.config.page_size,
            )
        self._insert(request, cache, request.prompt[: request.prefix_tokens])
        if self._prefix_flight:
            self.scheduler.computing(request.rid, request.keys[request.published :])

    def _insert(self, request: Request, cache: list | None, held: list[int]) -> None:
        """Hand ``request`` to mlx-lm, its ``cache`` holding the tokens ``held`` (the
        prompt's first ones); a hybrid model's prefill chunks end at its snapshot pages
        and its shared end."""
        options: dict[str, Any] = {
            "max_tokens": [request.params.max_tokens],
            "caches": [cache],  # a None cache is a fresh one (mlx-lm's insert), though its hint says List[List[Any]]
            "all_tokens": [held],
            "samplers": [sampler(request.params)],
            "logits_processors": [logits_processors(request.params)],
        }
        if request.snapshot_pages or request.shared_end:
            segments = prefill_segments(
                request.prompt, len(held), self.config.page_size, request.snapshot_pages, [request.shared_end]
            )
            (request.uid,) = self.generator.insert_segments([segments], **options)
        else:
            (request.uid,) = self.generator.insert([request.prompt[len(held) :]], **options)
        self._running[request.uid] = request

    def _snapshot_at(self, leader: Request, page: int) -> None:
        """Keep a running hybrid leader's state after its prompt page ``page`` too: the end
        of a prefix that a follower waits for (DESIGN §7), which the leader has not reached
        (the page is in flight). mlx-lm cuts prefill chunks only where a sequence is
        inserted, so the leader leaves the batch with its cache and goes in again from
        where it is, cut there as well; it computes nothing twice."""
        if page in leader.snapshot_pages:
            return
        leader.snapshot_pages = sorted({*leader.snapshot_pages, page})
        assert leader.uid is not None  # running
        ((cache, held),) = self.generator.remove([leader.uid], return_prompt_caches=True).values()
        del self._running[leader.uid]
        leader.resumed = len(held) - leader.prefix_tokens
        self._insert(leader, cache, list(held))

    def _deliver(self, request: Request, response) -> None:
        """A step's token to the request's stream, first thing after the step: publishing
        the pages its prompt filled (``Publisher.on_prefill``) comes after, off its time
        to first token."""
        if request.t_first_token is None:
            request.t_first_token = time.perf_counter()
        if response.finish_reason != "stop":  # the EOS token is not part of the output
            request.output.append(response.token)
            if request.params.logprobs is not None:  # before the token: a reader of the stream finds both
                request.logprobs.append(token_logprob(response.logprobs, response.token, request.params.logprobs))
            request._tokens.put(response.token)

    def _on_token(self, request: Request, response) -> None:
        """After the step's publishing: the answer's pages, and the end of a finished request."""
        if response.finish_reason is None:
            if self.publisher is not None:
                self.publisher.on_decode(request, response)
            return
        if self.publisher is not None:
            self.publisher.at_end(request, response)
        self._end(request, response.finish_reason)

    def _end(self, request: Request, reason: str, exc: BaseException | None = None) -> None:
        """End a request once: out of the batch (mlx-lm drops a finished one itself),
        its pins released, out of its flight, counted, its stream ended."""
        if request.done:
            return
        if (
            request.uid is not None
            and self._running.pop(request.uid, None) is not None
            and reason in (CANCELLED, ERROR)
        ):
            self.generator.remove([request.uid])
        if self.l3_wait is not None:
            self.l3_wait.ended(request)
        if request.pinned and self.store is not None:  # pins are the store's
            pinned, request.pinned = request.pinned, []
            self.store.release(pinned)
        if reason in (CANCELLED, ERROR):
            self.scheduler.withdraw(request)
        else:
            self.scheduler.finished(request.rid)
        request.error = _one_line(exc) if exc is not None else None
        request.t_done = time.perf_counter()
        request.finish_reason = reason
        self.totals.count(request)
        request._tokens.put(None)

    # -- results and lifecycle -------------------------------------------------

    def result(self, request: Request) -> dict:
        """The JSON-ready record of a finished request (DESIGN §8)."""
        return request_record(request, self.loaded, self.config.page_size)

    def view(self) -> EngineView:
        with self.scheduler.arrived:  # the scheduler's lock: queue and flights seen at one moment
            return EngineView(
                MappingProxyType(dict(self._running)),
                self.scheduler.pending(),
                self._serving is not None and self._serving.is_alive(),
                self.scheduler.flights.view(),
                self.scheduler.prefix.view(),
            )

    def stats(self) -> EngineStats:
        """Engine totals and this process's store counters."""
        window = Window(self.config.window_s, self.cached_tokens.rate())
        store = None if self.store is None else self.store.stats()
        return EngineStats(self.totals.snapshot(), window, self.profile.summary(), store)

    def close(self, timeout_s: float | None = None) -> int | None:
        """Stop serving (``stop``: the requests already submitted finish first), then
        flush the store to L3 and persist counters; the engine is unusable after.
        Closing twice does nothing. None once closed; with ``timeout_s``, the store's
        flush and close (on L3, which may be frozen) get that long: past it they are
        left running on a daemon thread (which ends with the process; an LMDB or Redis
        write commits whole or not at all) and the pages not in L3 yet are returned."""
        if self._closed:
            return None
        self.stop()
        self._closed = True
        if self.store is not None and timeout_s is None:
            self._close_store()
        elif self.store is not None:
            unflushed = self.store.accounts.unflushed()
            closing = threading.Thread(target=self._close_store, name="kvtier-close", daemon=True)
            closing.start()
            closing.join(timeout_s)
            if closing.is_alive():
                return unflushed()
        if self.prefix_caches is not None:
            self.prefix_caches.close()
        self.generator.close()
        return None

    def _close_store(self) -> None:
        assert self.store is not None, "closing the store of an engine without one"
        self.profile.refit_stale()
        stats = self.stats()  # keep what online refinement learned, and the last window
        self.store.accounts.put_meta(
            self.loaded.profile_key(self.geometry, self.namespace.codecs), self.profile.to_dict()
        )
        assert stats.costmodel is not None  # an engine's stats always have its cost model
        self.store.accounts.put_meta("last_run", LastRun(self.loaded.name, stats.windowed, stats.costmodel).to_json())
        self.store.close(extra_counters={"engine": self.totals.to_dict()})

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        """Close; leaving on an exception cancels the requests instead of finishing them."""
        if exc_type is not None:
            self.stop(cancel=True)
        self.close()


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
