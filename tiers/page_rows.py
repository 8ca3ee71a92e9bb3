"""A page's device array row by row, whatever its layout (``PageGeometry.shape``).

An L1 page, full or partial, is one mlx array: ``(layers, 2, kv_heads, tokens,
head_dim)`` when every row has one shape (or its fused form), its values flat when rows
differ in shape (Gemma 4's window and global heads); each block of rows of one shape
is then a 5-d view of its part (``PageGeometry.block_shapes``). Whoever reads or makes
such an array by its rows or tokens goes through here, so the flat layout is known in
one place.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .page import PageGeometry


def num_tokens(kv: mx.array, geometry: PageGeometry) -> int:
    """Tokens in a page's array (a partial page has fewer than a page)."""
    return kv.shape[3] if geometry.uniform else kv.size * geometry.page_size // math.prod(geometry.shape)


def blocks(kv: mx.array, geometry: PageGeometry) -> list[mx.array]:
    """Each block of a page's array (``PageGeometry.blocks``) as its 5-d view, in row
    order; a uniform page's whole array."""
    if geometry.uniform:
        return [kv]
    out, at = [], 0
    for shape in geometry.block_shapes(num_tokens(kv, geometry)):
        out.append(kv[at : at + math.prod(shape)].reshape(shape))
        at += math.prod(shape)
    return out


def shapes(geometry: PageGeometry) -> list[PageGeometry]:
    """The uniform geometry of each of ``blocks``: the page's own when it is uniform."""
    return [geometry] if geometry.uniform else [geometry.block(i) for i in range(len(geometry.blocks))]


def rows(kv: mx.array, geometry: PageGeometry) -> list[tuple[mx.array, mx.array]]:
    """Each row's K and V, ``(1, kv_heads, tokens, head_dim)`` views, in row order (of
    ``kv``'s rows: a join's group of layers too)."""
    return [pair for part, shape in zip(blocks(kv, geometry), shapes(geometry)) for pair in _split(part, shape)]


def _split(part: mx.array, shape: PageGeometry) -> list[tuple[mx.array, mx.array]]:
    """The rows of one block's 5-d array cut into K and V views: by one ``mx.split``
    where K and V are apart (one lazy operation for them all: a restore's join makes
    these for every layer), else by ``PageGeometry.key_value``."""
    if shape.fused:
        return [shape.key_value(part, r) for r in range(len(part))]
    pieces = list(mx.split(part.reshape(2 * len(part), *part.shape[2:]), 2 * len(part))) if len(part) else []
    return list(zip(pieces[0::2], pieces[1::2]))


def row(keys: mx.array, values: mx.array, shape: PageGeometry) -> mx.array:
    """One row of a page of the uniform geometry ``shape`` from its K and V, each
    ``(kv_heads, tokens, head_dim)``: ``PageGeometry.key_value``'s inverse."""
    return mx.concatenate([keys, values], axis=-1)[None] if shape.fused else mx.stack([keys, values])


def joined(parts: list[mx.array], geometry: PageGeometry) -> mx.array:
    """A page's array from its blocks' 5-d arrays (``blocks``' inverse)."""
    if geometry.uniform:
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]
    return mx.concatenate([part.reshape(-1) for part in parts])


def first_tokens(kv: mx.array, geometry: PageGeometry, n: int) -> mx.array:
    """The page's array of its first ``n`` tokens."""
    return joined([part[:, :, :, :n] for part in blocks(kv, geometry)], geometry)
