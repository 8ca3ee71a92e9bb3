"""Pages in and out of mlx-lm's per-layer caches, by layer kind (DESIGN §3a).

A page's rows are the model's attention layers in ``PageGeometry.rows`` order (global
layers first, then window layers). Per kind, the one cache class that mlx-lm builds
for it:

- ``KVCache`` (global attention): every token, at its position;
- ``RotatingKVCache`` (sliding window, ``keep`` 0): the last ``max_size`` tokens. A
  one-sequence cache taken out of a batch (``extract``) holds them in temporal order,
  the newest last, so token ``t`` is at ``t - (offset - held)``; a token the window has
  left cannot be published (``page_kv`` returns None). A restored prefix of ``p``
  tokens gives it the last ``min(p, max_size)`` tokens, which is what mlx-lm's own cache
  holds for the next step (its prefill keeps ``max_size - 1`` and adds the chunk);
- ``ArraysCache`` (recurrent state): no rows; its arrays after the cache's last token
  are a snapshot (``snapshot``), every state layer's arrays in model order as one flat
  uint8 array, put back by ``cache_from`` with the KV before it.

A ``CacheList`` (a layer of several caches, such as Falcon-H1's Mamba state and KV) is
its caches in order: the geometry's layers are the model's ``leaves``, so a CacheList
layer is one state layer and one attention layer to every function here, and the cache
handed back to mlx-lm keeps its CacheLists (their caches are changed in place).
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.models.cache import CacheList, RotatingKVCache, make_prompt_cache

from kvtier.tiers import page_rows
from kvtier.tiers.page import PageGeometry


def leaves(caches: list) -> list:
    """The model's caches with each ``CacheList`` replaced by its caches, in order: what
    ``PageGeometry``'s layer indices count."""
    return [leaf for c in caches for leaf in (c.caches if isinstance(c, CacheList) else (c,))]


def offset(caches: list, geometry: PageGeometry) -> int:
    """Tokens in a one-sequence mlx-lm cache (its first attention layer's offset)."""
    return leaves(caches)[geometry.rows[0]].offset


def _held(c) -> tuple[mx.array, mx.array, int]:
    """A one-sequence cache's keys and values, and the position of their first token."""
    keys, values, offset = c.state[:3]
    return keys, values, (offset - keys.shape[2] if isinstance(c, RotatingKVCache) else 0)


def page_kv(caches: list, geometry: PageGeometry, start: int, end: int) -> mx.array | None:
    """Tokens ``start..end`` of a one-sequence mlx-lm cache in page layout
    (``tiers.page_rows``), a new array; None when a window layer no longer holds them."""
    held, flat = [], leaves(caches)
    for layer in geometry.rows:
        keys, values, first = _held(flat[layer])
        if start < first:
            return None
        held.append((keys[0, :, start - first : end - first], values[0, :, start - first : end - first]))
    parts, at = [], 0
    for shape in page_rows.shapes(geometry):  # the page's, or each block's of its own row shape
        parts.append(mx.stack([page_rows.row(k, v, shape) for k, v in held[at : at + shape.num_layers]]))
        at += shape.num_layers
    return page_rows.joined(parts, geometry)


def snapshot(caches: list, geometry: PageGeometry) -> mx.array:
    """The state layers' arrays of a one-sequence mlx-lm cache as one flat uint8 array."""
    flat = leaves(caches)
    arrays = [a for layer in geometry.state_layers for a in flat[layer].cache]
    return mx.concatenate([mx.contiguous(a).reshape(-1).view(mx.uint8) for a in arrays])


def _put_state(cache: list, geometry: PageGeometry, state: mx.array) -> None:
    at, flat = 0, leaves(cache)
    for layer in geometry.state_layers:
        for i, (dtype, shape) in enumerate(geometry.kinds[layer].arrays):
            n = math.prod(shape) * getattr(mx, dtype).size
            flat[layer][i] = state[at : at + n].view(getattr(mx, dtype)).reshape(shape)
            at += n


def cache_from(
    model,
    geometry: PageGeometry,
    layers: list[tuple[mx.array, mx.array]],
    num_tokens: int,
    state: mx.array | None = None,
) -> list:
    """A fresh mlx-lm cache holding a restored ``num_tokens``-token prefix: ``layers``
    are the restore's rows (a window row holds at least the window's last tokens),
    ``state`` a hybrid model's snapshot after them."""
    cache = make_prompt_cache(model)
    if state is not None:
        _put_state(cache, geometry, state)
    flat = leaves(cache)
    for (keys, values), layer in zip(layers, geometry.rows):
        c = flat[layer]
        if isinstance(c, RotatingKVCache):
            n = min(num_tokens, c.max_size)
            c.state = (keys[:, :, -n:], values[:, :, -n:], num_tokens, c.keep, c.max_size, n)
        else:
            c.state = (keys, values, num_tokens)
    return cache


def append_rows(cache: list, geometry: PageGeometry, kv: mx.array) -> None:
    """Append ``kv`` (a page's layout of some tokens, ``tiers.page_rows``) to each layer."""
    flat = leaves(cache)
    for (keys, values), layer in zip(page_rows.rows(kv, geometry), geometry.rows):
        flat[layer].update_and_fetch(keys, values)
