"""Per-request sampling on mlx-lm: a sampler for a request's settings, and the
log-probabilities reported with each output token."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, make_logits_processors, make_sampler

from .request import SamplingParams, TokenLogprob


def sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
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


def logits_processors(params: SamplingParams) -> list:
    """mlx-lm's processors for ``logit_bias`` and the presence and frequency penalties."""
    return make_logits_processors(
        params.logit_bias, presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty
    )


def token_logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    """The chosen token's log-probability and the ``top`` best at its position, from the
    vector mlx-lm sampled from."""
    # mlx types item() as any scalar and tolist() as a list or a scalar; a float vector
    # gives a float, and a 1-D array a flat list.
    chosen = cast(float, logprobs[token].item())
    if not top:
        return TokenLogprob(chosen, [])
    ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
    order = mx.argsort(-logprobs[ids])
    ids = ids[order]
    best = zip(cast(list[int], ids.tolist()), cast(list[float], logprobs[ids].tolist()))
    return TokenLogprob(chosen, list(best))
