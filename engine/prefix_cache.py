"""The mlx-lm cache a request starts from: its restored prefix, built from the store.

A plain plan restores its pages and hands them over as one cache; an overlapped plan
(Cake) computes the front while a thread loads the rest; after the last stored page,
the start of an L1 page that the prompt shares (a partial page) is appended. The
prompt's last token is always left to compute, so mlx-lm has a token to start from.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvtier.tiers.hierarchy import RestoredPrefix, TieredStore

from .cache_layers import append_rows, cache_from
from .config import EngineConfig
from .publisher import Publisher
from .request import Request


class PrefixCaches:
    """Builds each admitted request's starting cache; owns the loader thread of overlapped plans."""

    def __init__(self, store: TieredStore, model, config: EngineConfig, publisher: Publisher) -> None:
        self.store, self.model, self.config, self.publisher = store, model, config, publisher
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvtier-restore")  # overlapped loads

    def build(self, request: Request, matched_pages: int) -> list | None:
        """The cache holding ``request.plan``'s prefix, then the shared start of the L1 page
        after it when no stored page of the ``matched_pages`` follows; None if empty."""
        if self.store.geometry.snapshot_nbytes:
            return self.restored_with_state(request, matched_pages)
        cache = self.restored(request)
        if request.prefix_tokens == matched_pages * self.config.page_size:  # no stored page follows
            cache = self.reuse_partial(request, cache)
        return cache

    def restored(self, request: Request) -> list | None:
        """A fresh mlx-lm cache holding the plan's prefix (None if empty); sets
        ``request.restored`` and ``request.prefix_tokens``.

        An overlapped plan (Cake) computes pages ``l1_pages .. first_loaded`` here while
        a thread does the host side of loading pages ``first_loaded .. restore_pages``
        (finding, checking, decoding them: no mlx work off this thread); the loaded
        pages are then joined and appended to the computed ones.
        """
        plan, size, keys = request.plan, self.config.page_size, request.keys
        assert plan is not None, "restoring a request admission did not plan"
        if not plan.overlap_pages or self.store.geometry.window is not None:  # a window model restores serially
            request.restored = self.store.restore(
                keys[: plan.restore_pages], request.prompt, parents=request.parents, read=request.l3_read
            )
            request.pinned = list(request.restored.keys)
            request.prefix_tokens = request.restored.num_pages * size
            return self.cache_from(request.restored.layers, request.prefix_tokens)
        head = self.store.restore(keys[: plan.l1_pages], request.prompt, parents=request.parents, read=request.l3_read)
        request.pinned = list(head.keys)
        loading = self._loader.submit(
            self.store.begin,
            keys[: plan.restore_pages],
            request.prompt,
            plan.first_loaded,
            ahead=True,
            parents=request.parents,
            read=request.l3_read,
        )
        try:
            cache = self.cache_from(head.layers, head.num_pages * size) or make_prompt_cache(self.model)
            self.prefill(cache, request.prompt[head.num_pages * size : plan.first_loaded * size])
            # computed over stored copies: kept in L1 too, not written through (they are below)
            self.publisher.publish(request, cache, plan.first_loaded, through=False)
        finally:  # the loaded pages are pinned even when computing failed: they are released with the others
            tail = self.store.finish(loading.result())
            request.pinned += tail.keys
        request.restored = RestoredPrefix(head.keys + tail.keys, head.sources + tail.sources, [])
        request.prefix_tokens = (plan.first_loaded + tail.num_pages) * size
        for c, (k, v) in zip(cache, tail.layers):  # the computed tokens (its buffers run past them), then the loaded
            done = c.offset
            c.state = (
                mx.concatenate([c.keys[:, :, :done], k], axis=2),
                mx.concatenate([c.values[:, :, :done], v], axis=2),
                request.prefix_tokens,
            )
        return cache

    def restored_with_state(self, request: Request, matched_pages: int) -> list | None:
        """A hybrid model's cache: the plan's pages with the state after them, from a
        snapshot (the store cuts the pages back to one) or, when the plan takes every
        matched page, from the L1 partial page after them with its state. Serial. Sets
        ``request.shared_end`` where the prompt leaves an L1 page after the matched ones
        midway, past what is restored (its prefill keeps a state there)."""
        assert request.plan is not None, "restoring a request admission did not plan"
        size, restore = self.config.page_size, request.plan.restore_pages
        then = None
        after = request.prompt[matched_pages * size : len(request.prompt) - 1]
        if restore == matched_pages:
            then = self.store.partials.match(request.parents[restore], after)
        shared_end = matched_pages * size + self.store.partials.shared(request.parents[matched_pages], after)
        keys = request.keys[:restore]
        request.restored = self.store.restore(
            keys, request.prompt, then=then, parents=request.parents, read=request.l3_read
        )
        request.pinned = list(request.restored.keys)
        request.partial_tokens = request.restored.partial_tokens
        request.prefix_tokens = request.restored.num_pages * size + request.partial_tokens
        request.shared_end = shared_end if shared_end % size and shared_end > request.prefix_tokens else 0
        if not request.prefix_tokens:
            return None
        state = request.restored.state
        return cache_from(self.model, self.store.geometry, request.restored.layers, request.prefix_tokens, state)

    def reuse_partial(self, request: Request, cache: list | None) -> list | None:
        """Append to the restored prefix the start of the L1 page after it that the
        prompt shares (a previous request's last partial page, or a page this prompt
        leaves midway: DESIGN §8a); those tokens count as L1. The prompt's last token
        is always computed."""
        done, size = request.prefix_tokens, self.config.page_size
        after = request.prompt[done : min(done + size, len(request.prompt) - 1)]
        match = self.store.partials.match(request.parents[done // size], after)
        if match is None:
            return cache
        cache = cache or make_prompt_cache(self.model)
        append_rows(cache, self.store.geometry, match.kv)
        request.partial_tokens = match.num_tokens
        request.prefix_tokens += match.num_tokens
        return cache

    def prefill(self, cache: list, tokens: list[int]) -> None:
        """Run the model over ``tokens`` into ``cache``, in mlx-lm's prefill steps."""
        step = self.config.prefill_step_size
        for i in range(0, len(tokens), step):
            self.model(mx.array([tokens[i : i + step]]), cache=cache)
            mx.eval([c.state for c in cache])

    def cache_from(self, layers: list[tuple[mx.array, mx.array]], num_tokens: int) -> list | None:
        """An mlx-lm cache holding these per-row K/V; None (mlx-lm makes one) when empty."""
        return cache_from(self.model, self.store.geometry, layers, num_tokens) if num_tokens else None

    def close(self) -> None:
        self._loader.shutdown()
