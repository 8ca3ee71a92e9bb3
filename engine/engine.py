"""The engine: mlx-lm's BatchGenerator with prefixes restored from, and published to, the store.

A request's path (DESIGN §2): tokens -> page keys -> locate -> restore the
stored prefix into a fresh mlx-lm KV cache -> ``BatchGenerator.insert`` with that
cache and the remaining tokens -> after every step, publish the pages that became
full -> decode -> finish -> release pins.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from costmodel.plan import Profile, plan_restore, profile_key
from tiers.counters import add_into
from tiers.hierarchy import StoreConfig, TieredStore
from tiers.page import Namespace, page_keys, reusable_pages

from .model import LoadedModel
from .request import Request, SamplingParams

log = logging.getLogger(__name__)


class InputError(ValueError):
    """A prompt the model cannot take (one clear line)."""


@dataclass
class EngineConfig:
    page_size: int = 128
    offload: bool = True
    store: StoreConfig = field(default_factory=StoreConfig)
    prefill_step_size: int = 512
    cache_salt: str = ""


class Engine:
    """Generates for many requests at once, reusing stored KV pages."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.geometry = loaded.geometry(self.config.page_size)
        self.namespace = Namespace(
            loaded.fingerprint, self.geometry.dtype, self.config.page_size,
            cache_salt=self.config.cache_salt,
        )
        self.store = (
            TieredStore(self.geometry, self.namespace, self.config.store)
            if self.config.offload else None
        )
        # Freed buffers are reused only below mlx's cache limit; restores need it raised.
        previous = mx.set_cache_limit(1 << 30)
        mx.set_cache_limit(max(previous, 1 << 30))
        self.generator = BatchGenerator(
            loaded.model,
            stop_tokens=[[t] for t in loaded.tokenizer.eos_token_ids],
            prefill_step_size=self.config.prefill_step_size,
        )
        self.profile = self._load_profile()
        self.vocab_size = loaded.model.args.vocab_size if hasattr(loaded.model, "args") else None
        self._waiting: list[Request] = []
        self._running: dict[int, Request] = {}
        self._next_rid = 0
        # store_seconds: time the step loop spent in the store (restore, publish): the offload overhead
        self.totals: dict = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0,
                             "store_seconds": 0.0, "sources": {}}

    def _load_profile(self) -> Profile:
        """The calibrated cost model of this machine and model, else conservative defaults."""
        disk = self.store.disk if self.store is not None else None
        saved = disk.get_meta(profile_key(self.namespace.digest())) if disk is not None else None
        if saved:
            return Profile.from_dict(saved)
        log.info("no calibrated cost model for this machine and model: using defaults (run `kvtier calibrate`)")
        return Profile.defaults()

    # -- submission ------------------------------------------------------------

    def submit(self, prompt: Sequence[int] | str, params: SamplingParams | None = None) -> Request:
        """Queue a prompt (text is tokenized as ``tokenizer.encode`` does)."""
        tokens = self.loaded.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(tokens)
        keys = page_keys(self.namespace, tokens)[: reusable_pages(len(tokens), self.config.page_size)]
        request = Request(self._next_rid, tokens, params or SamplingParams(), self.config.page_size, keys)
        self._next_rid += 1
        self._waiting.append(request)
        return request

    def _check_prompt(self, tokens: list[int]) -> None:
        if not tokens:
            raise InputError("empty prompt")
        bad = [t for t in tokens if t < 0 or (self.vocab_size and t >= self.vocab_size)]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")

    # -- the step loop ---------------------------------------------------------

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self._waiting or self._running:
            self.step()

    def generate(self, prompts: Sequence[Sequence[int] | str], params: SamplingParams | None = None) -> list[Request]:
        """Submit prompts as one burst and run them to completion."""
        requests = [self.submit(p, params) for p in prompts]
        self.run()
        return requests

    def step(self) -> None:
        """Admit waiting requests, run one BatchGenerator step, publish and collect."""
        for request in self._waiting:
            self._admit(request)
        self._waiting.clear()
        t0 = time.perf_counter()
        prompt_responses, generation_responses = self.generator.next()
        self._observe_prefill(prompt_responses, generation_responses, time.perf_counter() - t0)
        self._publish_new_pages(prompt_responses)
        for response in generation_responses:
            self._on_token(self._running[response.uid], response.token, response.finish_reason)

    def _admit(self, request: Request) -> None:
        """Plan, restore the chosen prefix (matched now, not at enqueue), hand it to mlx-lm."""
        cache, restored = None, 0
        if self.store is not None and request.keys:
            t0 = time.perf_counter()
            matched = self.store.locate(request.keys, request.prompt)
            request.plan = plan_restore(matched, len(request.prompt), self.config.page_size,
                                        self.geometry.nbytes, self.profile)
            links_before = self.store.stats()["links"]
            request.restored = self.store.restore(request.keys[: request.plan.restore_pages], request.prompt)
            self._observe_links(links_before)
            restored = request.restored_tokens
            request.published = request.restored.num_pages
            if restored:
                cache = self._cache_from(request.restored.layers, restored)
            self.totals["store_seconds"] += time.perf_counter() - t0
        params = request.params
        sampler = make_sampler(params.temperature, params.top_p)
        (request.uid,) = self.generator.insert(
            [request.prompt[restored:]],
            max_tokens=[params.max_tokens],
            caches=[cache],
            all_tokens=[request.prompt[:restored]],
            samplers=[sampler],
        )
        self._running[request.uid] = request

    def _observe_links(self, before: dict) -> None:
        """Feed the link models with what this restore really moved (online refinement)."""
        for name, after in self.store.stats()["links"].items():
            if name in self.profile.links and after["bytes"] > before[name]["bytes"]:
                self.profile.links[name].observe(after["bytes"] - before[name]["bytes"],
                                                 seconds=after["seconds"] - before[name]["seconds"])

    def _observe_prefill(self, prompt_responses: list, generation_responses: list, seconds: float) -> None:
        """Feed the compute model with steps that only prefilled one request's chunk."""
        clean = (len(prompt_responses) == 1 and not generation_responses
                 and not prompt_responses[0].end_of_prompt
                 and all(r.t_first_token is None for r in self._running.values()))
        for response in prompt_responses:
            request = self._running[response.uid]
            chunk, cached = response.progress[0] - request.prefilled, request.restored_tokens + request.prefilled
            request.prefilled = response.progress[0]
            if clean and chunk > 0:
                self.profile.compute.observe(chunk, cached, seconds=seconds)

    def _cache_from(self, layers: list[tuple[mx.array, mx.array]], num_tokens: int) -> list:
        cache = make_prompt_cache(self.loaded.model)
        for c, (keys, values) in zip(cache, layers):
            c.state = (keys, values, num_tokens)
        return cache

    def _publish_new_pages(self, prompt_responses: list) -> None:
        """Publish every page that became full in this step (DESIGN §7)."""
        if self.store is None:
            return
        for response in prompt_responses:
            request = self._running[response.uid]
            in_cache = request.restored_tokens + response.progress[0]
            ready = min(len(request.keys), in_cache // self.config.page_size)
            if ready > request.published:
                self._publish(request, ready)

    def _publish(self, request: Request, ready: int) -> None:
        t0 = time.perf_counter()
        caches, _ = self.generator.extract_cache([request.uid])[request.uid]
        size = self.config.page_size
        pages = []
        for i in range(request.published, ready):
            a, b = i * size, (i + 1) * size
            kv = mx.stack([mx.stack([c.keys[0, :, a:b], c.values[0, :, a:b]]) for c in caches])
            pages.append((i, kv))
        mx.eval([kv for _, kv in pages])
        for i, kv in pages:
            self.store.publish(request.keys[i], request.prompt[i * size : (i + 1) * size], kv)
        request.published = ready
        self.totals["store_seconds"] += time.perf_counter() - t0

    def _on_token(self, request: Request, token: int, finish_reason: str | None) -> None:
        now = time.perf_counter()
        if request.t_first_token is None:
            request.t_first_token = now
        if finish_reason != "stop":  # the EOS token is not part of the output
            request.output.append(token)
        if finish_reason is None:
            return
        request.finish_reason = finish_reason
        request.t_done = now
        del self._running[request.uid]
        if self.store is not None and request.restored:
            self.store.release(request.restored.keys)
        self._count(request)

    def _count(self, request: Request) -> None:
        add_into(self.totals, {
            "requests": 1,
            "prompt_tokens": len(request.prompt),
            "generated_tokens": len(request.output),
            "sources": request.sources(),
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
            "output_token_ids": request.output,
            "text": self.loaded.tokenizer.decode(request.output),
            "finish_reason": request.finish_reason,
            "plan": request.plan.to_dict() if request.plan else None,
            "ttft_s": round(request.t_first_token - request.t_submit, 6),
            "latency_s": round(request.t_done - request.t_submit, 6),
        }

    def stats(self) -> dict:
        """Engine totals and this process's store counters."""
        stats = {"engine": dict(self.totals), "costmodel": self.profile.summary()}
        if self.store is not None:
            stats.update(self.store.stats())
        return stats

    def close(self) -> None:
        """Flush the store to L3 and persist counters; the engine is unusable after."""
        if self.store is not None:
            if self.store.disk is not None:  # keep what online refinement learned
                self.store.disk.put_meta(profile_key(self.namespace.digest()), self.profile.to_dict())
            self.store.close(extra_counters={"engine": self.totals})
        self.generator.close()
