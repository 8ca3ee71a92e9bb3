"""The engine: mlx-lm's BatchGenerator with prefixes restored from, and published to, the store.

A request's path (DESIGN §2): tokens -> page keys -> locate -> restore the
stored prefix into a fresh mlx-lm KV cache -> ``BatchGenerator.insert`` with that
cache and the remaining tokens -> after every step, publish the pages that became
full -> decode -> finish -> release pins. With prefix single flight, a request whose
next pages a running request is computing may first wait for them (``_hold_for_prefix``,
priced by ``costmodel.plan.plan_wait``; the bookkeeping is ``engine.prefix_flights``).

Every request ends exactly once (``_end``): finished, cancelled (``Request.cancel``),
or failed ("error": an exception while admitting, publishing or collecting it fails
that request only; one inside mlx-lm's batch step fails the requests in the batch).
Ending takes it out of the batch, releases its pins, withdraws it from single
flight, counts it and ends its stream. All mlx work runs on the thread that steps
(the serving thread after ``start``); other threads only submit, stream and cancel.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_top_p, make_logits_processors, make_sampler

from kvtier.costmodel.plan import READ_LINKS, Profile, plan_restore, plan_wait
from kvtier.tiers.counters import add_into
from kvtier.tiers.hierarchy import RestoredPrefix, StoreConfig, TieredStore
from kvtier.tiers.policy import DEFAULT_POLICY
from kvtier.tiers.page import PageKey, Source, page_keys, reusable_pages

from .flights import FlightCoordinator
from .metrics import RateWindow
from .models.load import LoadedModel
from .request import CANCELLED, ERROR, Request, SamplingParams, TokenLogprob
from .scheduler import Scheduler
from .text import without_broken_end

log = logging.getLogger(__name__)


class InputError(ValueError):
    """A prompt or setting the model cannot take (one clear line); ``param`` names the setting."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_prompt(loaded: LoadedModel, tokens: Sequence[int], params: SamplingParams) -> None:
    """InputError unless the model can take ``tokens`` and generate ``params.max_tokens``
    after them (callers may check before building an engine: nothing is touched)."""
    args = getattr(loaded.model, "args", None)
    vocab, context = getattr(args, "vocab_size", None), getattr(args, "max_position_embeddings", None)
    if not tokens:
        raise InputError("empty prompt")
    if context and len(tokens) + params.max_tokens > context:
        raise InputError(f"prompt of {len(tokens)} tokens plus max_tokens {params.max_tokens} exceeds "
                         f"the model's context of {context} tokens")
    bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    bad = [t for t in params.logit_bias or {} if t < 0 or (vocab and t >= vocab)]
    if bad:  # mlx-lm would fail the whole batch on it
        raise InputError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "logit_bias")


@dataclass
class EngineConfig:
    page_size: int = 128
    offload: bool = True
    store: StoreConfig = field(default_factory=StoreConfig)
    prefill_step_size: int = 512
    cache_salt: str = ""
    single_flight: str = "prefix"  # or "after-prefill" | "at-completion" (exact inputs only) | "off"
    publish: str = "incremental"  # after every step, or "at-completion" only
    publish_answers: bool = False  # at the end, also the pages the answer filled (a server's next turn)
    max_running: int = 32  # requests in the BatchGenerator at once; the rest wait
    refresh_window: int = 128  # waiting requests whose L1 pages are touched before admission
    window_s: float = 30.0  # cached tokens per second are measured over this window
    policy: str = DEFAULT_POLICY  # eviction policy of the store's tiers (tiers.policy)


class Engine:
    """Generates for many requests at once, reusing stored KV pages."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.geometry = loaded.geometry(self.config.page_size)
        self.namespace = loaded.namespace(self.geometry, self.config.cache_salt)
        self.root = self.namespace.digest()  # the key "before" a sequence's first page
        self.store = (
            TieredStore(self.geometry, self.namespace, replace(self.config.store, policy=self.config.policy))
            if self.config.offload else None
        )
        self.generator = BatchGenerator(
            loaded.model,
            stop_tokens=[[t] for t in loaded.tokenizer.eos_token_ids],
            prefill_step_size=self.config.prefill_step_size,
        )
        self.profile = self._load_profile()
        policy = self.config.single_flight if self.store is not None else "off"
        self._prefix_flight = policy == "prefix"  # exact inputs are a prefix case: no exact flights then
        flights = FlightCoordinator("off" if self._prefix_flight else policy)
        self.scheduler = Scheduler(flights, self.config.max_running, self.config.refresh_window)
        self.cached_tokens = RateWindow(self.config.window_s)
        self._running: dict[int, Request] = {}
        self._rids = itertools.count()
        self._serving: threading.Thread | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-restore")  # overlapped loads
        self._stop = threading.Event()
        self._cancel_all = False  # set by stop(cancel=True); the stepping thread cancels
        self._closed = False
        # requests .. sources: of finished requests; cancelled, errors: the others.
        # store_seconds: time the step loop spent in the store (restore, publish): the offload overhead
        self.totals: dict = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0,
                             "store_seconds": 0.0, "l1_hit_loss_tokens": 0, "sources": {},
                             "cancelled": 0, "errors": 0, "waited_tokens": 0, "wait_s": 0.0}

    def _load_profile(self) -> Profile:
        """The calibrated cost model of this machine and model, else conservative defaults."""
        saved = self.store.get_meta(self.loaded.profile_key(self.geometry)) if self.store is not None else None
        if saved:
            return Profile.from_dict(saved)
        log.info("no calibrated cost model for this machine and model: using defaults (run `kvtier calibrate`)")
        return Profile.defaults()

    # -- submission ------------------------------------------------------------

    def submit(self, prompt: Sequence[int] | str, params: SamplingParams | None = None) -> Request:
        """Queue a prompt (text is tokenized as ``tokenizer.encode`` does); thread-safe.
        Refused (RuntimeError) once the engine is stopping or closed."""
        tokens = self.loaded.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = params or SamplingParams()
        check_prompt(self.loaded, tokens, params)
        keys = page_keys(self.namespace, tokens)[: reusable_pages(len(tokens), self.config.page_size)]
        request = Request(next(self._rids), tokens, params, self.config.page_size, keys)
        request.l1_tokens_at_enqueue = self._l1_tokens(self.store.locate(keys, tokens)) if self.store else 0
        flight_key = hashlib.blake2b(np.asarray(tokens, "<u4").tobytes(), digest_size=16,
                                     key=self.root).digest()
        with self.scheduler.arrived:  # the lock under which the serving loop decides to exit
            if self._stop.is_set():
                raise RuntimeError("the engine is stopped: submit before stop() or close()")
            self.scheduler.add(request, flight_key)
        return request

    def _l1_tokens(self, matched: Sequence[Source]) -> int:
        return sum(self.config.page_size for s in matched if s is Source.L1)

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
            for request in self.scheduler.refresh_candidates():
                self.store.touch(request.keys)
        while admitted := self.scheduler.admit(len(self._running)):  # again while some were held
            for request in admitted:
                self._guarded(request, self._admit)
        for request in [r for r in self._running.values() if r.cancelled]:
            self._end(request, CANCELLED)
        if not self._running:
            return  # everyone left is a held follower; their leader is done
        t0 = time.perf_counter()
        try:
            prompt_responses, generation_responses = self.generator.next()
        except Exception as exc:
            self._fail_batch(exc)
            return
        self._observe_prefill(prompt_responses, generation_responses, time.perf_counter() - t0)
        for response in prompt_responses:
            self._guarded(self._running[response.uid], self._on_prefill, response)
        for response in generation_responses:
            if (request := self._running.get(response.uid)) is not None:  # not failed in this step
                self._guarded(request, self._on_token, response)

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
            log.warning("request %d failed: %s", request.rid, _one_line(exc),
                        exc_info=log.isEnabledFor(logging.DEBUG))
            self._end(request, ERROR, exc)

    def _admit(self, request: Request) -> None:
        """Plan, bring in the chosen prefix (matched now, not at enqueue), hand it to mlx-lm;
        or hold the request to wait for pages another request is computing."""
        cache = None
        if request.t_held is not None:
            request.wait_s += time.perf_counter() - request.t_held
            request.t_held = None
        if self.store is not None:
            t0 = time.perf_counter()
            matched = self.store.locate(request.keys, request.prompt)
            profile = self.profile.capped(self.config.store.throttle)
            if self._prefix_flight and self._hold_for_prefix(request, matched, profile):
                return
            request.plan = plan_restore(matched, len(request.prompt), self.config.page_size,
                                        self.geometry.nbytes, profile, self.config.store.codec)
            request.l1_tokens_at_admission = self._l1_tokens(matched)
            links_before = self.store.stats()["links"]
            cache = self._prefix_cache(request)
            if request.prefix_tokens == len(matched) * self.config.page_size:  # no stored page follows
                cache = self._reuse_partial(request, cache)
            self._observe_links(links_before)
            request.published = request.prefix_tokens // self.config.page_size
            self.cached_tokens.add(request.restored.num_pages * self.config.page_size + request.partial_tokens)
            self.totals["store_seconds"] += time.perf_counter() - t0
        request.t_admit = time.perf_counter()
        done = request.prefix_tokens
        (request.uid,) = self.generator.insert(
            [request.prompt[done:]],
            max_tokens=[request.params.max_tokens],
            caches=[cache],
            all_tokens=[request.prompt[:done]],
            samplers=[_sampler(request.params)],
            logits_processors=[make_logits_processors(request.params.logit_bias,
                                                      presence_penalty=request.params.presence_penalty,
                                                      frequency_penalty=request.params.frequency_penalty)],
        )
        self._running[request.uid] = request
        if self._prefix_flight:
            self.scheduler.computing(request.rid, request.keys[request.published:])

    def _hold_for_prefix(self, request: Request, matched: list[Source], profile: Profile) -> bool:
        """Hold ``request`` if its pages after the ``matched`` ones are being computed by
        a running request and the cost model prefers waiting for them (prefix single
        flight, DESIGN §7). Its deadline is set at its first hold and never extended."""
        leader, count = self.scheduler.in_flight(request.keys, len(matched))
        now = time.perf_counter()
        if not count or (request.wait_deadline is not None and now >= request.wait_deadline):
            return False
        lead = next(r for r in self._running.values() if r.rid == leader)
        size = self.config.page_size
        plan = plan_wait(matched, count, lead.prefix_tokens + lead.prefilled, len(request.prompt), size,
                         self.geometry.nbytes, profile, self.config.store.codec)
        if not plan.wait:
            return False
        deadline = now + plan.deadline_s
        request.wait_deadline = min(deadline, request.wait_deadline or deadline)
        request.waited_tokens = max(request.waited_tokens, count * size)
        request.t_held = now
        self.scheduler.hold_for_prefix(request, leader, request.keys[len(matched) + count - 1], request.wait_deadline)
        return True

    def _prefix_cache(self, request: Request) -> list | None:
        """A fresh mlx-lm cache holding the plan's prefix (None if empty); sets
        ``request.restored`` and ``request.prefix_tokens``.

        An overlapped plan (Cake) computes pages ``l1_pages .. first_loaded`` here while
        a thread does the host side of loading pages ``first_loaded .. restore_pages``
        (finding, checking, decoding them: no mlx work off this thread); the loaded
        pages are then joined and appended to the computed ones.
        """
        plan, size, keys = request.plan, self.config.page_size, request.keys
        if not plan.overlap_pages:
            request.restored = self.store.restore(keys[: plan.restore_pages], request.prompt)
            request.pinned = list(request.restored.keys)
            request.prefix_tokens = request.restored.num_pages * size
            return self._cache_from(request.restored.layers, request.prefix_tokens)
        head = self.store.restore(keys[: plan.l1_pages], request.prompt)
        request.pinned = list(head.keys)
        loading = self._loader.submit(self.store.begin, keys[: plan.restore_pages], request.prompt,
                                      plan.first_loaded, ahead=True)
        try:
            cache = self._cache_from(head.layers, head.num_pages * size) or make_prompt_cache(self.loaded.model)
            self._prefill(cache, request.prompt[head.num_pages * size : plan.first_loaded * size])
            self._publish(request, cache, plan.first_loaded)  # computed over stored copies: kept in L1 too
        finally:  # the loaded pages are pinned even when computing failed: they are released with the others
            tail = self.store.finish(loading.result())
            request.pinned += tail.keys
        request.restored = RestoredPrefix(head.keys + tail.keys, head.sources + tail.sources, [])
        request.prefix_tokens = (plan.first_loaded + tail.num_pages) * size
        for c, (k, v) in zip(cache, tail.layers):  # the computed tokens (its buffers run past them), then the loaded
            done = c.offset
            c.state = (mx.concatenate([c.keys[:, :, :done], k], axis=2),
                       mx.concatenate([c.values[:, :, :done], v], axis=2), request.prefix_tokens)
        return cache

    def _reuse_partial(self, request: Request, cache: list | None) -> list | None:
        """Append to the restored prefix the start of the L1 page after it that the
        prompt shares (a previous request's last partial page, or a page this prompt
        leaves midway: DESIGN §8a); those tokens count as L1. The prompt's last token
        is always computed."""
        done, size = request.prefix_tokens, self.config.page_size
        parent = request.keys[done // size - 1] if done else self.root
        match = self.store.match_partial(parent, request.prompt[done : min(done + size, len(request.prompt) - 1)])
        if match is None:
            return cache
        cache = cache or make_prompt_cache(self.loaded.model)
        for layer, c in enumerate(cache):
            c.update_and_fetch(match.kv[layer, 0][None], match.kv[layer, 1][None])
        request.partial_tokens = match.num_tokens
        request.prefix_tokens += match.num_tokens
        return cache

    def _prefill(self, cache: list, tokens: list[int]) -> None:
        """Run the model over ``tokens`` into ``cache``, in mlx-lm's prefill steps."""
        step = self.config.prefill_step_size
        for i in range(0, len(tokens), step):
            self.loaded.model(mx.array([tokens[i : i + step]]), cache=cache)
            mx.eval([c.state for c in cache])

    def _observe_links(self, before: dict) -> None:
        """Feed the link models with what this restore really moved (online refinement)."""
        throttled = {link for tier in self.config.store.throttle for link in READ_LINKS[tier]}  # they time the throttle
        for name, after in self.store.stats()["links"].items():
            if name in self.profile.links and name not in throttled and after["bytes"] > before[name]["bytes"]:
                self.profile.links[name].observe(after["bytes"] - before[name]["bytes"],
                                                 seconds=after["seconds"] - before[name]["seconds"])

    def _observe_prefill(self, prompt_responses: list, generation_responses: list, seconds: float) -> None:
        """Feed the compute model with steps that only prefilled one request's chunk."""
        clean = (len(prompt_responses) == 1 and not generation_responses
                 and not prompt_responses[0].end_of_prompt
                 and all(r.t_first_token is None for r in self._running.values()))
        for response in prompt_responses:
            request = self._running[response.uid]
            chunk, cached = response.progress[0] - request.prefilled, request.prefix_tokens + request.prefilled
            request.prefilled = response.progress[0]
            if clean and chunk > 0:
                self.profile.compute.observe(chunk, cached, seconds=seconds)

    def _cache_from(self, layers: list[tuple[mx.array, mx.array]], num_tokens: int) -> list | None:
        """An mlx-lm cache holding these per-layer K/V; None (mlx-lm makes one) when empty."""
        if not num_tokens:
            return None
        cache = make_prompt_cache(self.loaded.model)
        for c, (keys, values) in zip(cache, layers):
            c.state = (keys, values, num_tokens)
        return cache

    def _on_prefill(self, request: Request, response) -> None:
        """Publish every page of the request that became full in this step (DESIGN §7);
        at the end of a leader's prompt, release its single-flight followers."""
        if self.store is None:
            return
        early = response.end_of_prompt and self.scheduler.is_leader(request.rid)
        if self.config.publish == "incremental" or early:
            in_cache = request.prefix_tokens + response.progress[0]
            ready = min(len(request.keys), in_cache // self.config.page_size)
            if ready > request.published:
                caches, _ = self.generator.extract_cache([request.uid])[request.uid]
                self._publish(request, caches, ready)
        if response.end_of_prompt:
            self.scheduler.prefilled(request.rid)

    def _publish(self, request: Request, caches: list, ready: int,
                 keys: Sequence[PageKey] | None = None, tokens: Sequence[int] | None = None) -> None:
        """Store pages ``published .. ready`` of a request from its mlx-lm cache: pages of
        its prompt, or of ``tokens`` (with their ``keys``), the sequence the cache holds."""
        t0 = time.perf_counter()
        size = self.config.page_size
        keys, tokens = keys or request.keys, tokens or request.prompt
        pages = []
        for i in range(request.published, ready):
            if not self.store.wants(keys[i]):  # recomputed over an L1 page: nothing to copy out
                continue
            pages.append((i, _page_kv(caches, i * size, (i + 1) * size)))
        mx.eval([kv for _, kv in pages])
        for i, kv in pages:
            self.store.publish(keys[i], tokens[i * size : (i + 1) * size], kv, parent=keys[i - 1] if i else self.root)
        self.scheduler.published(request.rid, keys[request.published : ready])
        request.published = ready
        self.totals["store_seconds"] += time.perf_counter() - t0

    def _publish_at_end(self, request: Request, response) -> None:
        """At the end, publish the full pages of the sequence not published yet, and keep
        its last partial page in L1 (``TieredStore.publish_partial``). The sequence is
        the prompt or, with ``publish_answers``, the prompt and the answer, keyed by
        the generated tokens, so that a next turn whose prompt holds this prompt and
        this answer restores both (DESIGN §8a). mlx-lm feeds every token it reports
        back into the cache, the last one too: the cache holds ``all_tokens``, prompt
        and output (EOS included)."""
        caches = response.prompt_cache
        tokens = list(response.all_tokens) if self.config.publish_answers else request.prompt
        tokens = tokens[: caches[0].offset]
        keys = page_keys(self.namespace, tokens)
        if len(keys) > request.published:
            self._publish(request, caches, len(keys), keys, tokens)
        done = len(keys) * self.config.page_size
        if done < len(tokens):
            t0 = time.perf_counter()
            kv = _page_kv(caches, done, len(tokens))
            mx.eval(kv)
            self.store.publish_partial(keys[-1] if keys else self.root, tokens[done:], kv)
            self.totals["store_seconds"] += time.perf_counter() - t0

    def _on_token(self, request: Request, response) -> None:
        now = time.perf_counter()
        if request.t_first_token is None:
            request.t_first_token = now
        if response.finish_reason != "stop":  # the EOS token is not part of the output
            request.output.append(response.token)
            if request.params.logprobs is not None:  # before the token: a reader of the stream finds both
                request.logprobs.append(_token_logprob(response.logprobs, response.token, request.params.logprobs))
            request._tokens.put(response.token)
        if response.finish_reason is None:
            return
        if self.store is not None:
            self._publish_at_end(request, response)
        self._end(request, response.finish_reason)

    def _end(self, request: Request, reason: str, exc: BaseException | None = None) -> None:
        """End a request once: out of the batch (mlx-lm drops a finished one itself),
        its pins released, out of its flight, counted, its stream ended."""
        if request.done:
            return
        if self._running.pop(request.uid, None) is not None and reason in (CANCELLED, ERROR):
            self.generator.remove([request.uid])
        if request.pinned:
            pinned, request.pinned = request.pinned, []
            self.store.release(pinned)
        if reason in (CANCELLED, ERROR):
            self.scheduler.withdraw(request)
        else:
            self.scheduler.finished(request.rid)
        request.error = _one_line(exc) if exc is not None else None
        request.t_done = time.perf_counter()
        request.finish_reason = reason
        self._count(request)
        request._tokens.put(None)

    def _count(self, request: Request) -> None:
        if request.finish_reason in (CANCELLED, ERROR):
            self.totals["cancelled" if request.finish_reason == CANCELLED else "errors"] += 1
            return
        add_into(self.totals, {
            "requests": 1,
            "prompt_tokens": len(request.prompt),
            "generated_tokens": len(request.output),
            "l1_hit_loss_tokens": request.l1_tokens_at_enqueue - request.l1_tokens_at_admission,
            "sources": request.sources(),
            "waited_tokens": request.waited_tokens,
            "wait_s": request.wait_s,
        })

    # -- results and lifecycle -------------------------------------------------

    def result(self, request: Request) -> dict:
        """The JSON-ready record of a finished request (DESIGN §8)."""
        return {
            "id": request.rid,
            "prompt_tokens": len(request.prompt),
            "sources": request.sources(),
            "page_size": self.config.page_size,
            "model": self.loaded.name,
            "model_name": self.loaded.label,
            "output_token_ids": request.output,
            "text": without_broken_end(self.loaded.tokenizer.decode(request.output)),
            "finish_reason": request.finish_reason,
            "error": request.error,
            "plan": request.plan.to_dict() if request.plan else None,
            "l1_tokens_at_enqueue": request.l1_tokens_at_enqueue,
            "l1_tokens_at_admission": request.l1_tokens_at_admission,
            "l1_hit_loss": request.l1_tokens_at_enqueue - request.l1_tokens_at_admission,
            "waited_tokens": request.waited_tokens,
            "wait_s": round(request.wait_s, 6),
            "ttft_s": None if request.t_first_token is None else round(request.t_first_token - request.t_submit, 6),
            "latency_s": None if request.t_done is None else round(request.t_done - request.t_submit, 6),
        }

    def stats(self) -> dict:
        """Engine totals and this process's store counters."""
        window = {"window_s": self.config.window_s, "cached_tokens_per_s": self.cached_tokens.rate()}
        stats = {"engine": dict(self.totals), "windowed": window, "costmodel": self.profile.summary()}
        if self.store is not None:
            stats.update(self.store.stats())
        return stats

    def close(self) -> None:
        """Stop serving (``stop``: the requests already submitted finish first), then
        flush the store to L3 and persist counters; the engine is unusable after.
        Closing twice does nothing."""
        if self._closed:
            return
        self.stop()
        self._closed = True
        if self.store is not None:
            stats = self.stats()  # keep what online refinement learned, and the last window
            self.store.put_meta(self.loaded.profile_key(self.geometry), self.profile.to_dict())
            self.store.put_meta("last_run", {"model": self.loaded.name, "windowed": stats["windowed"],
                                             "costmodel": stats["costmodel"]})
            self.store.close(extra_counters={"engine": self.totals})
        self._loader.shutdown()
        self.generator.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        """Close; leaving on an exception cancels the requests instead of finishing them."""
        if exc_type is not None:
            self.stop(cancel=True)
        self.close()


def _page_kv(caches: list, start: int, end: int) -> mx.array:
    """Tokens ``start..end`` of a one-sequence mlx-lm cache in page layout:
    (layers, 2, kv_heads, tokens, head_dim), a new array."""
    return mx.stack([mx.stack([c.keys[0, :, start:end], c.values[0, :, start:end]]) for c in caches])


def _sampler(params: SamplingParams):
    """mlx-lm's sampler for these settings. With a seed, the request draws from its own
    random key, so the same seed samples the same tokens whatever else runs in the batch."""
    if params.seed is None or params.temperature == 0:
        return make_sampler(params.temperature, params.top_p)
    key = mx.random.key(params.seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        if params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        return mx.random.categorical(logprobs * (1 / params.temperature), key=draw)

    return sample


def _token_logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability and the ``top`` best at its position, from the
    vector mlx-lm sampled from."""
    chosen = logprobs[token].item()
    if not top:
        return TokenLogprob(chosen, [])
    ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
    order = mx.argsort(-logprobs[ids])
    ids = ids[order]
    return TokenLogprob(chosen, list(zip(ids.tolist(), logprobs[ids].tolist())))


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
