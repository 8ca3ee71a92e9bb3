"""Pages whose rows differ in shape (Gemma 4's window and global heads, DeepSeek-V3.2's
indexer beside its latent): one flat array a page, each block of rows of one shape a
5-d view of its part; rows whose keys are wider than their values (multi-head latent
attention): K and V side by side. Read and made row by row through ``page_rows``."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from kvtier.tiers import page_rows
from kvtier.tiers.page import GLOBAL, Block, LayerKind, PageGeometry, RowShape

WINDOW = LayerKind("window", window=8)
KINDS = (WINDOW, GLOBAL, WINDOW, GLOBAL, WINDOW)  # rows: the 2 global layers, then the 3 window layers
WIDE, NARROW = RowShape(2, 8, 8), RowShape(1, 4, 4)
TWO_SHAPES = PageGeometry(5, 2, 8, 4, "float32", KINDS, (NARROW, WIDE, NARROW, WIDE, NARROW))
ONE_SHAPE = PageGeometry(5, 2, 8, 4, "float32", KINDS)
LATENT = PageGeometry(3, 1, 8, 4, "float32", shapes=(RowShape(1, 8, 2),) * 3)  # keys 8 wide, values 2
INDEXED = PageGeometry(4, 1, 8, 4, "float32", shapes=(RowShape(1, 8, 2), WIDE) * 2)  # two shapes, one kind
GEOMETRIES = pytest.mark.parametrize(
    "geometry",
    [TWO_SHAPES, ONE_SHAPE, LATENT, INDEXED],
    ids=["window and global shapes", "one shape", "latent", "latent and indexer"],
)


def block_values(geometry: PageGeometry, tokens: int = 0) -> list[np.ndarray]:
    """Each block's array, every value distinct across the page."""
    out, at = [], 0
    for shape in geometry.block_shapes(tokens):
        out.append(np.arange(at, at + math.prod(shape), dtype=np.float32).reshape(shape))
        at += math.prod(shape)
    return out


def test_a_latent_row_is_its_keys_and_values_side_by_side():
    assert LATENT.fused and LATENT.uniform and LATENT.shape == (3, 1, 1, 4, 10) and LATENT.nbytes == 3 * 4 * 10 * 4


def test_a_page_of_two_row_shapes_is_flat_and_sized_by_its_blocks():
    g = TWO_SHAPES
    global_bytes, window_bytes = 2 * 2 * 2 * 4 * 8 * 4, 3 * 2 * 1 * 4 * 4 * 4  # rows, K/V, heads, tokens, dim, float32
    assert not g.uniform and g.segments == (global_bytes, window_bytes)
    assert g.shape == ((global_bytes + window_bytes) // 4,) and g.nbytes == global_bytes + window_bytes
    assert g.block(0) == PageGeometry(2, 2, 8, 4, "float32") and g.block(1) == PageGeometry(3, 1, 4, 4, "float32")
    assert ONE_SHAPE.uniform and ONE_SHAPE.shape == (5, 2, 2, 4, 8) and len(set(ONE_SHAPE.block_shapes())) == 2


def test_rows_of_one_kind_are_grouped_by_shape_in_order_of_first_appearance():
    g = INDEXED  # layers: latent, indexer, latent, indexer
    assert g.rows == (0, 2, 1, 3) and g.blocks == (Block("kv", RowShape(1, 8, 2), 2), Block("kv", WIDE, 2))
    assert not g.uniform and not g.fused and g.segments == () and g.segment_blocks(0) == [0, 1]
    assert TWO_SHAPES.rows == (1, 3, 0, 2, 4) and TWO_SHAPES.segment_blocks(1) == [1]


@GEOMETRIES
def test_blocks_are_views_of_a_pages_array(geometry):
    parts = block_values(geometry)
    page = np.concatenate([p.reshape(-1) for p in parts]).reshape(geometry.shape)
    for i, part in enumerate(parts):
        view = geometry.block_array(page, i)
        assert np.shares_memory(view, page) and np.array_equal(view, part)


def expected_rows(parts: list[mx.array], geometry: PageGeometry) -> list[tuple[mx.array, mx.array]]:
    """Each row's K and V, read off the blocks' arrays by hand."""
    rows = []
    for part, block in zip(parts, geometry.blocks):
        width = block.shape.key_dim
        for r in range(len(part)):
            fused = (part[r, :, :, :, :width], part[r, :, :, :, width:])
            rows.append(fused if block.shape.fused else (part[r, 0][None], part[r, 1][None]))
    return rows


@GEOMETRIES
def test_a_device_page_row_by_row_and_cut_to_its_first_tokens(geometry):
    parts = [mx.array(p) for p in block_values(geometry)]
    kv = page_rows.joined(parts, geometry)
    assert kv.shape == geometry.shape and page_rows.num_tokens(kv, geometry) == geometry.page_size
    expected = expected_rows(parts, geometry)
    rebuilt, at = [], 0  # the page made again from each row's K and V
    for shape in page_rows.shapes(geometry):
        rebuilt.append(mx.stack([page_rows.row(k[0], v[0], shape) for k, v in expected[at : at + shape.num_layers]]))
        at += shape.num_layers
    assert mx.array_equal(page_rows.joined(rebuilt, geometry), kv)
    assert len(page_rows.rows(kv, geometry)) == geometry.num_layers
    for (k, v), (ek, ev) in zip(page_rows.rows(kv, geometry), expected):
        assert mx.array_equal(k, ek) and mx.array_equal(v, ev)
    cut = page_rows.first_tokens(kv, geometry, 3)
    assert page_rows.num_tokens(cut, geometry) == 3
    for (k, v), (ek, ev) in zip(page_rows.rows(cut, geometry), expected):
        assert mx.array_equal(k, ek[:, :, :3]) and mx.array_equal(v, ev[:, :, :3])


def test_a_row_shape_for_each_attention_layer():
    with pytest.raises(ValueError, match="one row shape for each of the 5 attention layers"):
        PageGeometry(5, 2, 8, 4, "float32", KINDS, (WIDE, NARROW))
