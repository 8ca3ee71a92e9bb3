"""Per-request sampling on mlx-lm: a sampler for a request's settings, and the
log-probabilities reported with each output token."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_logits_processors, make_sampler

from .request import SamplingParams, TokenLogprob


def sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """mlx-lm's sampler for these settings, after mlx-lm's ``top_k`` where one is set (a
    k of at least the vocabulary keeps every token). With a seed, the request draws from
    its own random key, so the same seed samples the same tokens whatever else runs in
    the batch."""
    sample = _sampler(params)
    if not params.top_k or params.temperature == 0:
        return sample
    k = params.top_k
    return lambda logprobs: sample(apply_top_k(logprobs, k) if k < logprobs.shape[-1] else logprobs)


def _sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
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
    """mlx-lm's processors for ``logit_bias`` and the presence and frequency penalties,
    then ours for ``forced`` and ``banned`` (which override them)."""
    processors = make_logits_processors(
        params.logit_bias, presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty
    )
    if params.forced:
        processors.append(_forcing(params.forced))
    if params.banned:
        processors.append(_banning(params.banned))
    return processors


def _forcing(tokens: list[int]) -> Callable[[mx.array, mx.array], mx.array]:
    """A processor that makes the first ``len(tokens)`` outputs those tokens. mlx-lm calls
    a sequence's processors once per output token, so the count of calls is the position."""
    step = 0

    def force(context: mx.array, logits: mx.array) -> mx.array:
        nonlocal step
        if step >= len(tokens):
            return logits
        token, step = tokens[step], step + 1
        only = mx.full(logits.shape, -mx.inf, logits.dtype)
        only[..., token] = 0.0
        return only

    return force


def _banning(sequences: list[list[int]]) -> Callable[[mx.array, mx.array], mx.array]:
    """A processor that never lets the output complete one of ``sequences``: where the
    tokens so far end with all but a sequence's last token, that last one is ruled out.
    Only the output is looked at (a sequence in the prompt bans nothing)."""
    step = 0
    output: list[int] = []

    def ban(context: mx.array, logits: mx.array) -> mx.array:
        nonlocal step
        if step:
            output.append(cast(int, context[-1].item()))
        step += 1
        ruled_out = [seq[-1] for seq in sequences if len(output) >= len(seq) - 1 and _ends_with(output, seq[:-1])]
        if not ruled_out:
            return logits
        logits = mx.array(logits)
        logits[..., ruled_out] = -mx.inf
        return logits

    return ban


def _ends_with(tokens: list[int], tail: list[int]) -> bool:
    return not tail or tokens[-len(tail) :] == tail


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
