"""Publication: a request's pages go from its mlx-lm cache into the store.

During prefill every page that became full is published after the step (DESIGN §7),
so that another request can restore it, or a follower held by single flight waits
for it; at the end, the pages not published yet and the last partial page (kept in
L1). ``request.published`` counts the leading pages known to be in the store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from kvtier.tiers.hierarchy import TieredStore
from kvtier.tiers.page import KeyChain, Namespace, key_chain, partial_key

from .cache_layers import offset, page_kv, snapshot
from .config import EngineConfig
from .request import Request
from .scheduler import Scheduler
from .totals import EngineTotals


class Publisher:
    """Copies pages out of mlx-lm caches into the store; its time counts as store time."""

    def __init__(
        self,
        store: TieredStore,
        scheduler: Scheduler,
        generator: BatchGenerator,
        config: EngineConfig,
        namespace: Namespace,
        totals: EngineTotals,
    ) -> None:
        self.store, self.scheduler, self.generator, self.config = store, scheduler, generator, config
        self.namespace, self.totals = namespace, totals

    def on_prefill(self, request: Request, response) -> None:
        """Publish every page of the request that became full in this step; at the end of
        a leader's prompt, release its single-flight followers."""
        early = response.end_of_prompt and self.scheduler.is_leader(request.rid)
        if self.store.geometry.snapshot_nbytes:
            self.with_state(request, response)
        elif self.config.publish == "incremental" or early:
            in_cache = request.prefix_tokens + response.progress[0]
            ready = min(len(request.keys), in_cache // self.config.page_size)
            if ready > request.published:
                caches, _ = self.generator.extract_cache([request.uid])[request.uid]
                self.publish(request, caches, ready)
        if response.end_of_prompt:
            self.scheduler.prefilled(request.rid)

    def with_state(self, request: Request, response) -> None:
        """A hybrid model's prefill step: publish the pages that became full, the state
        where a snapshot is due (``request.snapshot_pages``: the step ended there), and
        as a partial page with the state after it (L1) the tokens after the last full
        page at the end of the prompt and where it leaves an L1 page midway
        (``request.shared_end``). Whatever the publish setting: a state exists only at
        the step that reaches it."""
        caches, _ = self.generator.extract_cache([request.uid])[request.uid]
        g, size, keys = self.store.geometry, self.config.page_size, request.keys
        held = offset(caches, g)  # tokens in the cache (at the end of the prompt: all of them)
        ready = min(len(keys), held // size)
        if ready > request.published:
            self.publish(request, caches, ready)
        t0 = time.perf_counter()
        if held % size == 0 and held // size in request.snapshot_pages and held // size <= request.published:
            state = snapshot(caches, g)
            mx.eval(state)
            self.store.publish_snapshot(keys[held // size - 1], request.prompt[held - size : held], state)
        if response.end_of_prompt and request.published == len(keys) and 0 < held - len(keys) * size < size:
            self.keep_partial(request, caches, len(keys), held)
        elif held == request.shared_end and held // size <= request.published:
            self.keep_partial(request, caches, held // size, held)
        self.totals.store_seconds += time.perf_counter() - t0

    def keep_partial(self, request: Request, caches: list, pages: int, held: int) -> None:
        """Keep the prompt's tokens after its first ``pages`` pages, up to ``held`` (the
        tokens in the cache), in L1 as a partial page with the state after them."""
        g, done = self.store.geometry, pages * self.config.page_size
        kv, state = page_kv(caches, g, done, held), snapshot(caches, g)
        if kv is not None:
            mx.eval(kv, state)
            self.store.partials.publish(request.parents[pages], request.prompt[done:held], kv, state)

    def publish(
        self,
        request: Request,
        caches: list,
        ready: int,
        chain: KeyChain | None = None,
        tokens: Sequence[int] | None = None,
        through: bool = True,
    ) -> None:
        """Store pages ``published .. ready`` of a request from its mlx-lm cache: pages of
        its prompt, or of ``tokens`` (with their ``chain``), the sequence the cache holds;
        ``through=False``: none of them written through to L3 now (``TieredStore.publish``)."""
        t0 = time.perf_counter()
        size = self.config.page_size
        keys, parents = (chain.keys, chain.parents) if chain is not None else (request.keys, request.parents)
        tokens = tokens or request.prompt
        pages = []
        for i in range(request.published, ready):
            if not self.store.wants(keys[i]):  # recomputed over an L1 page: nothing to copy out
                continue
            kv = page_kv(caches, self.store.geometry, i * size, (i + 1) * size)
            if kv is None:  # a window layer has left it: the pages from here stay unpublished
                ready = i
                break
            pages.append((i, kv))
        mx.eval([kv for _, kv in pages])
        for i, kv in pages:
            cost = self.store.page_cost(i)
            self.store.publish(keys[i], tokens[i * size : (i + 1) * size], kv, cost, parent=parents[i], through=through)
        self.scheduler.published(request.rid, keys[request.published : ready])
        request.published = ready
        self.totals.store_seconds += time.perf_counter() - t0

    def on_decode(self, request: Request, response) -> None:
        """With ``publish_answers``, a sliding-window or hybrid model's answer pages are
        published as they fill: a window layer holds only its last tokens by the end,
        and a state exists only at the step that reaches it (a snapshot is kept every
        ``request.snapshot_spacing`` pages of the sequence). mlx-lm may have fed the newest
        token to the model already (it runs a step ahead), so the cache is read when
        either the sequence or the sequence without its newest token ends a page."""
        g, size = self.store.geometry, self.config.page_size
        sequence = request.prompt + request.output
        if g.window is None and not g.snapshot_nbytes or not self.config.publish_answers:
            return
        if len(sequence) // size <= request.published or len(sequence) % size not in (0, 1):
            return
        caches, _ = self.generator.extract_cache([request.uid])[request.uid]
        tokens = sequence[: offset(caches, g)]
        chain = key_chain(self.namespace, tokens, request.root)
        keys = chain.keys
        if len(tokens) % size or len(keys) <= request.published:
            return
        self.publish(request, caches, len(keys), chain, tokens)
        if g.snapshot_nbytes and len(keys) % request.snapshot_spacing == 0 and request.published == len(keys):
            state = snapshot(caches, g)
            mx.eval(state)
            self.store.publish_snapshot(keys[-1], tokens[-size:], state)

    def at_end(self, request: Request, response) -> None:
        """At the end, publish the full pages of the sequence not published yet, and keep
        its last partial page in L1 (``TieredStore.partials``; a hybrid model's
        with the state after it). The sequence is the prompt or, with
        ``publish_answers``, the prompt and the answer, keyed by the generated tokens,
        so that a next turn whose prompt holds this prompt and this answer restores both
        (DESIGN §8a). mlx-lm feeds every token it reports back into the cache, the last
        one too: the cache holds ``all_tokens``, prompt and output (EOS included). A
        hybrid model's state is after all of them, so without ``publish_answers`` its
        partial page is the one kept at the end of its prompt (``with_state``). The request
        keeps the keys it ended with (``ended_in``, the partial page's last), for a hold."""
        g = self.store.geometry
        if g.snapshot_nbytes and not self.config.publish_answers:
            return
        caches = response.prompt_cache
        tokens = list(response.all_tokens) if self.config.publish_answers else request.prompt
        tokens = tokens[: offset(caches, g)]
        chain = key_chain(self.namespace, tokens, request.root)
        keys = chain.keys
        if len(keys) > request.published:
            self.publish(request, caches, len(keys), chain, tokens)
        done = len(keys) * self.config.page_size
        request.ended_in = list(keys)
        if done < len(tokens) and request.published >= len(keys):  # the pages before it are stored
            t0 = time.perf_counter()
            kv = page_kv(caches, g, done, len(tokens))
            if kv is not None:
                state = snapshot(caches, g) if g.snapshot_nbytes else None
                mx.eval(kv, state)
                parent, tail = chain.parents[len(keys)], tokens[done:]
                self.store.partials.publish(parent, tail, kv, state)
                request.ended_in.append(partial_key(parent, tail))
                request.tail_tokens = len(tail)
            self.totals.store_seconds += time.perf_counter() - t0
