"""A page's device array row by row, whatever its layout (``PageGeometry.shape``).

An L1 page, full or partial, is one mlx array: ``(layers, 2, kv_heads, tokens,
head_dim)`` when every row has one shape, its values flat when the window rows have
a shape of their own (Gemma 4); each segment is then a 5-d view of its part
(``PageGeometry.segment_shapes``). Whoever reads or makes such an array by its rows or
tokens goes through here, so the flat layout is known in one place.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .page import PageGeometry


def num_tokens(kv: mx.array, geometry: PageGeometry) -> int:
    """Tokens in a page's array (a partial page has fewer than a page)."""
    return kv.shape[3] if geometry.uniform else kv.size * geometry.page_size // math.prod(geometry.shape)


def segments(kv: mx.array, geometry: PageGeometry) -> list[mx.array]:
    """Each segment of a page's array as its ``(rows, 2, kv_heads, tokens, head_dim)``
    view, in row order."""
    if geometry.uniform:
        return [kv]
    out, at = [], 0
    for shape in geometry.segment_shapes(num_tokens(kv, geometry)):
        out.append(kv[at : at + math.prod(shape)].reshape(shape))
        at += math.prod(shape)
    return out


def rows(kv: mx.array, geometry: PageGeometry) -> list[tuple[mx.array, mx.array]]:
    """Each row's K and V, ``(1, kv_heads, tokens, head_dim)`` views, in row order."""
    return [(part[r, 0][None], part[r, 1][None]) for part in segments(kv, geometry) for r in range(part.shape[0])]


def joined(parts: list[mx.array], geometry: PageGeometry) -> mx.array:
    """A page's array from its segments' 5-d arrays (``segments``' inverse)."""
    if geometry.uniform:
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]
    return mx.concatenate([part.reshape(-1) for part in parts])


def first_tokens(kv: mx.array, geometry: PageGeometry, n: int) -> mx.array:
    """The page's array of its first ``n`` tokens."""
    return joined([part[:, :, :, :n] for part in segments(kv, geometry)], geometry)
