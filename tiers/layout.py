"""Where page bytes lie in host memory: the offset L2 slots, raw L3 payloads and every
join's output share, and the slot arena that keeps it. Pure numpy, no mlx: the record
codec (``tiers.l3.record``) needs the offset without loading the device tier."""

from __future__ import annotations

import numpy as np

# malloc returns 16-byte aligned memory and mlx puts its 8-byte size first: mlx's arrays
# start 8 past a 16-byte boundary; a fresh large one (a new mapping, behind malloc's 16-byte
# header) 24 past a 4 KiB boundary. An L1 page's bytes are such an array.
MLX_BUFFER_OFFSET = 24
MEMORY_PAGE = 4096
# Where L2 slots, raw L3 payloads (modulo 64) and every join's output start in a 4 KiB page.
SLOT_OFFSET = MLX_BUFFER_OFFSET + MEMORY_PAGE // 2


def slot_arena(slots: int, nbytes: int) -> np.ndarray:
    """``slots`` rows of ``nbytes`` (uint8) for page bytes. When ``nbytes`` is at least
    4 KiB, rows are a whole number of 4 KiB apart and each starts ``SLOT_OFFSET`` past a
    4 KiB boundary, as the join's output does (``tiers.join``): the join's copies pair
    aligned loads with aligned stores, and their sources never lie a few bytes behind
    their destinations modulo 4 KiB (such loads stall on false store-to-load
    dependencies: 4K aliasing). L1 pages lie half a 4 KiB page from it, at the same
    offset within a cache line."""
    stride = -(-nbytes // MEMORY_PAGE) * MEMORY_PAGE if nbytes >= MEMORY_PAGE else nbytes
    raw = np.empty(slots * stride + MEMORY_PAGE, dtype=np.uint8)
    start = (SLOT_OFFSET - raw.ctypes.data) % MEMORY_PAGE
    return raw[start : start + slots * stride].reshape(slots, stride)[:, :nbytes]
