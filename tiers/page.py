"""Page identity: what a page is, how it is keyed, and its byte layout.

A page is ``page_size`` consecutive prompt tokens and their K/V for every layer.
Its key chains the key of the page before it with its own tokens::

    key[-1] = H(namespace)            key[i] = H(key[i-1] || tokens of page i)

so a key names a whole prefix, never a page out of context. ``H`` is BLAKE2b
(16-byte digest), stable across processes and machines. The namespace holds
everything that changes KV content, so different models, dtypes, page sizes,
layouts, adapters or salts (a process's ``cache_salt``) never share a key. A
server's tenants share the namespace but not the root: each chain starts from the
caller's own root (``ChainRoot``, DESIGN §9a), except for the pages of a prefix the
operator declared shared.

Only full pages are chained. The last prompt token is always computed (its logits
start decoding), so an ``n``-token prompt has at most ``(n - 1) // page_size``
reusable pages. A request's last, partial page may be kept on the device under its
own key (``partial_key``) and reused up to the tokens a later prompt shares with it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from functools import cached_property
from typing import Any, NewType

import msgpack
import numpy as np

LAYOUT_VERSION = 1
KEY_BYTES = 16

PageKey = NewType("PageKey", bytes)


class Source(str, Enum):
    """Where a prompt token's KV finally came from (exactly one per token)."""

    L1 = "L1"
    L2 = "L2"
    L3 = "L3"
    RECOMPUTED = "recomputed"


def _hash(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the KV of a token sequence."""

    model_fingerprint: str
    kv_dtype: str
    page_size: int
    layout_version: int = LAYOUT_VERSION
    adapter_id: str = ""
    cache_salt: str = ""
    layers: str = ""  # PageGeometry.describe_layers(): empty for a model of global-attention layers only
    encryption: str = ""  # the L3 cipher's name (``tiers.l3.cipher``) when its records are encrypted
    codecs: str = ""  # the lossy codecs of its tiers (``tiers.quant.namespace_codecs``): "L3:q8"

    def digest(self) -> bytes:
        """Stable 16-byte digest; the root of every page key in this namespace. ``layers``,
        ``encryption`` and ``codecs`` are digested only when set, so a plain model's keys
        are what they always were; encrypted and plain pages never share a key, nor
        quantized and raw ones, nor pages of two quantizing codecs."""
        fields = asdict(self)
        for name in ("layers", "encryption", "codecs"):
            if not fields[name]:
                del fields[name]
        return _hash(msgpack.packb(fields, use_bin_type=True))


@dataclass(frozen=True)
class ChainRoot:
    """Where a sequence's key chain starts (DESIGN §9a): the caller's own root (a tenant's,
    narrowed by a ``cache_salt``), except for its first ``shared_pages`` pages, the whole
    pages of a prefix the operator declared shared, which are keyed from the namespace's
    digest like everyone's. The own root is mixed in at the first page past them, so a
    key after a shared prefix still names its caller. ``own`` None (or the namespace's
    digest) is the one implicit tenant: its keys are the plain chain."""

    own: bytes | None = None
    shared_pages: int = 0


IMPLICIT_ROOT = ChainRoot()  # the one implicit tenant: today's keys


@dataclass(frozen=True)
class KeyChain:
    """The keys of a sequence's full pages and the key before each: ``parents[i]`` comes
    before page ``i`` (``parents[len(keys)]`` before the partial page after them; an L1
    page is found by it, ``TieredStore.partials``). ``parents[i] == keys[i - 1]``
    except at page 0 (a root) and at the first page past a shared prefix (the caller's
    root mixed in)."""

    keys: list[PageKey]
    parents: list[bytes]


def key_chain(namespace: Namespace, tokens: Sequence[int] | np.ndarray, root: ChainRoot = IMPLICIT_ROOT) -> KeyChain:
    """The chained keys of every full page of ``tokens`` (the partial tail has none), from ``root``."""
    size, shared = namespace.page_size, namespace.digest()
    own = shared if root.own is None else root.own
    sharing = root.shared_pages > 0 and own != shared
    prev = shared if sharing else own
    keys: list[PageKey] = []
    parents: list[bytes] = []
    for start in range(0, len(tokens) + 1, size):
        if sharing and len(keys) == root.shared_pages:  # the first page past the shared prefix is the caller's
            prev = _hash(own, b"after shared", prev)
        parents.append(prev)
        if start + size > len(tokens):
            break
        prev = _hash(prev, np.asarray(tokens[start : start + size], dtype="<u4").tobytes())
        keys.append(PageKey(prev))
    return KeyChain(keys, parents)


def page_keys(namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[PageKey]:
    """Chained keys of every full page of ``tokens`` (the partial tail has none), from the namespace's root."""
    return key_chain(namespace, tokens).keys


def page_tokens(tokens: Sequence[int], index: int, page_size: int) -> tuple[int, ...]:
    """The token ids of page ``index`` of ``tokens``."""
    return tuple(tokens[index * page_size : (index + 1) * page_size])


def partial_key(parent: bytes, tokens: Sequence[int]) -> PageKey:
    """Key of a partial page (fewer than ``page_size`` tokens) after the page keyed
    ``parent``; never equal to a full page's key."""
    return PageKey(_hash(parent, b"partial", np.asarray(tokens, dtype="<u4").tobytes()))


def snapshot_key(page: bytes) -> PageKey:
    """Key of the state snapshot taken right after the page keyed ``page``; never a
    page's key."""
    return PageKey(_hash(page, b"snapshot"))


def shared_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def reusable_pages(num_tokens: int, page_size: int) -> int:
    """Pages of an ``num_tokens`` prompt that may be reused (the last token is computed)."""
    return max(num_tokens - 1, 0) // page_size


_NUMPY_STORAGE = {"bfloat16": "<u2", "float16": "<f2", "float32": "<f4"}


@dataclass(frozen=True)
class LayerKind:
    """What one layer keeps of a sequence (DESIGN §3a): ``"kv"``, every token (global
    attention); ``"window"``, the last ``window`` tokens and the first ``keep``
    (sliding-window attention, mlx-lm's ``RotatingKVCache``); ``"state"``, fixed-size
    recurrent state, ``arrays`` of (dtype, shape) (mlx-lm's ``ArraysCache``)."""

    name: str
    window: int = 0
    keep: int = 0
    arrays: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def describe(self) -> str:
        if self.name == "state":
            return "state:" + "+".join(f"{dtype}{list(shape)}" for dtype, shape in self.arrays)
        return self.name if self.name == "kv" else f"{self.name}:{self.window}:{self.keep}"

    @property
    def nbytes(self) -> int:
        """Bytes of a state layer's arrays (0 for attention layers)."""
        return sum(math.prod(shape) * np.dtype(_NUMPY_STORAGE[dtype]).itemsize for dtype, shape in self.arrays)


GLOBAL = LayerKind("kv")


@dataclass(frozen=True)
class RowShape:
    """What one attention layer keeps of each token: ``heads`` KV heads, keys ``key_dim``
    wide, values ``value_dim`` wide (multi-head latent attention keeps a latent as keys
    and a narrower rope part as values)."""

    heads: int
    key_dim: int
    value_dim: int

    @property
    def fused(self) -> bool:
        """Whether a row holds K and V side by side along the last axis (their widths differ)."""
        return self.key_dim != self.value_dim

    def array(self, rows: int, tokens: int) -> tuple[int, int, int, int, int]:
        """The shape of ``rows`` such rows of ``tokens`` tokens: ``(rows, 2, heads,
        tokens, key_dim)``, K then V; fused, ``(rows, 1, heads, tokens, key_dim + value_dim)``."""
        if self.fused:
            return (rows, 1, self.heads, tokens, self.key_dim + self.value_dim)
        return (rows, 2, self.heads, tokens, self.key_dim)


@dataclass(frozen=True)
class Block:
    """Consecutive rows of a page of one kind (``"kv"`` or ``"window"``) and one row shape."""

    kind: str
    shape: RowShape
    rows: int


@dataclass(frozen=True)
class PageGeometry:
    """Shape and dtype of one page's KV: ``(layers, 2, kv_heads, page_size, head_dim)``.

    The payload bytes of a page are this array in C order, K before V within a
    layer, so one page is one contiguous buffer in every tier.

    ``kinds`` gives each attention layer's kind in model order (empty: all global).
    A page's rows hold the global layers first, then the window layers (``rows``), so
    its bytes are two segments (``segments``) that a restore reads apart: the global
    segment of every page, the window segment only of the pages a window still sees
    (``window_pages``).

    ``shapes`` gives each attention layer's row shape in model order (empty: every one
    ``num_kv_heads`` heads of ``head_dim``). Within a kind, rows are grouped by shape
    (in order of first appearance), so a page is ``blocks`` of rows of one kind and one
    shape. A page of one row shape is the 5-d array above; of several (Gemma 4's window
    and global heads, DeepSeek-V3.2's indexer beside its latent), its values flat
    (``shape``), each block a 5-d view of its part (``block_array``, ``block``), so
    every tier still holds one contiguous buffer a page. A row whose keys and values
    differ in width (``RowShape.fused``) is K and V side by side, and ``key_value``
    cuts it back into the two.

    Every window layer has the same window and keep. Layers of kind ``"state"`` are
    no rows of a page: their state after a page is a snapshot (``snapshot_nbytes``
    bytes, the layers' arrays in model order), stored apart under ``snapshot_key``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str
    kinds: tuple[LayerKind, ...] = ()
    shapes: tuple[RowShape, ...] = ()

    def __post_init__(self) -> None:
        if self.shapes and len(self.shapes) != self.num_layers:
            raise ValueError(f"one row shape for each of the {self.num_layers} attention layers: {self.shapes}")
        windows = {(k.window, k.keep) for k in self.kinds if k.name == "window"}
        if len(windows) > 1 or len(self.rows) != self.num_layers:
            raise ValueError(f"one window and keep for every window layer, one kind per layer: {self.kinds}")

    @cached_property  # rows and blocks are read on every restore's path; the geometry is frozen
    def _ordered(self) -> tuple[tuple[int, str, RowShape], ...]:
        """(model layer, kind, row shape) of each row: global rows, then window rows, each
        kind's grouped by shape in order of first appearance."""
        kinds = self.kinds or (GLOBAL,) * self.num_layers
        attention = [(i, k.name) for i, k in enumerate(kinds) if k.name != "state"]
        shapes = self.shapes or (RowShape(self.num_kv_heads, self.head_dim, self.head_dim),) * len(attention)
        layers = [(i, name, shape) for (i, name), shape in zip(attention, shapes)]
        first: dict[tuple[str, RowShape], int] = {}  # where each (kind, shape) first appears
        for n, (_, name, shape) in enumerate(layers):
            first.setdefault((name, shape), n)
        return tuple(sorted(layers, key=lambda x: (x[1] != "kv", first[x[1], x[2]])))  # stable: model order within

    @property
    def rows(self) -> tuple[int, ...]:
        """The attention layer (model order) of each row of a page."""
        return tuple(layer for layer, _, _ in self._ordered)

    @cached_property
    def blocks(self) -> tuple[Block, ...]:
        """The page's rows as runs of one kind and one row shape, in row order."""
        runs: list[Block] = []
        for _, kind, shape in self._ordered:
            if runs and (runs[-1].kind, runs[-1].shape) == (kind, shape):
                runs[-1] = Block(kind, shape, runs[-1].rows + 1)
            else:
                runs.append(Block(kind, shape, 1))
        return tuple(runs)

    @property
    def global_rows(self) -> int:
        """Rows ``[0, global_rows)`` are global layers, the rest window layers."""
        return sum(k.name == "kv" for k in self.kinds) if self.kinds else self.num_layers

    @property
    def window(self) -> LayerKind | None:
        """The kind of the window layers; None without any."""
        return next((k for k in self.kinds if k.name == "window"), None)

    @cached_property  # read for every page a window model's restore joins
    def segments(self) -> tuple[int, ...]:
        """Byte lengths of a page's segments: (global rows, window rows) when the model
        has window layers, else () (one segment, the whole page)."""
        if self.window is None:
            return ()
        sizes = [math.prod(shape) * self.storage_dtype.itemsize for shape in self.block_shapes()]
        return tuple(sum(sizes[b] for b in self.segment_blocks(segment)) for segment in (0, 1))

    def segment_blocks(self, segment: int) -> list[int]:
        """The blocks of a record segment (0: global rows, 1: window rows; 0 is the
        whole page without window layers), in row order."""
        kind = "window" if segment else "kv"
        return [i for i, b in enumerate(self.blocks) if self.window is None or b.kind == kind]

    @cached_property
    def uniform(self) -> bool:
        """Whether every row has one shape (a page is then one 5-d array, ``shape``)."""
        return len({b.shape for b in self.blocks}) <= 1

    @cached_property  # on every restore's path, once a layer
    def fused(self) -> bool:
        """Whether a uniform page's rows hold K and V side by side (``RowShape.fused``)."""
        return self.uniform and bool(self.blocks) and self.blocks[0].shape.fused

    def block_shapes(self, tokens: int = 0) -> tuple[tuple[int, int, int, int, int], ...]:
        """Each block's array shape (``RowShape.array``) for ``tokens`` tokens (0: a page's)."""
        return tuple(b.shape.array(b.rows, tokens or self.page_size) for b in self.blocks)

    def block(self, index: int) -> PageGeometry:
        """The uniform geometry of one block's rows alone (all of kind global): what
        joining that block of pages needs."""
        return self._block_geometries[index]

    @cached_property  # made once: a restore joins block by block
    def _block_geometries(self) -> tuple[PageGeometry, ...]:
        made = []
        for b in self.blocks:
            shapes = (b.shape,) * b.rows if b.shape.fused else ()  # () where the default shape says it all
            made.append(PageGeometry(b.rows, b.shape.heads, b.shape.key_dim, self.page_size, self.dtype, shapes=shapes))
        return tuple(made)

    def block_array(self, page: np.ndarray, index: int) -> np.ndarray:
        """Block ``index`` of a page's array (either ``shape``, in the storage dtype) as
        its 5-d view."""
        shapes, flat = self.block_shapes(), page.reshape(-1)
        start = sum(math.prod(s) for s in shapes[:index])
        return flat[start : start + math.prod(shapes[index])].reshape(shapes[index])

    def key_value(self, rows: Any, row: int) -> tuple[Any, Any]:
        """Row ``row``'s K and V, each ``(1, kv_heads, tokens, head_dim)``, of the rows
        of a uniform page (numpy or mlx; views: one index expression each, as mlx makes
        a view of a slice of an array but may copy a slice of a slice)."""
        if self.fused:
            width = self.blocks[0].shape.key_dim
            return rows[row, :, :, :, :width], rows[row, :, :, :, width:]
        return rows[row, :1], rows[row, 1:]

    def window_pages(self, pages: int) -> list[int]:
        """The pages of a ``pages``-page prefix whose window rows its restore reads: those
        holding its first ``keep`` tokens and its last ``window`` tokens."""
        kind, size = self.window, self.page_size
        if kind is None:
            return list(range(pages))
        sink = range(min(pages, -(-kind.keep // size)))
        last = range(max(0, (pages * size - kind.window) // size), pages)
        return sorted({*sink, *last})

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The model layers of kind ``"state"``, in model order."""
        return tuple(i for i, k in enumerate(self.kinds) if k.name == "state")

    @property
    def snapshot_nbytes(self) -> int:
        """Bytes of one snapshot of the state layers (0: the model has none)."""
        return sum(k.nbytes for k in self.kinds)

    def describe_layers(self) -> str:
        """The layer kinds as the namespace digests them; empty when all are global."""
        return ",".join(k.describe() for k in self.kinds) if any(k.name != "kv" for k in self.kinds) else ""

    @cached_property  # on every restore's path; the geometry is frozen
    def shape(self) -> tuple[int, ...]:
        """A page's array in every tier: ``(layers, 2, kv_heads, page_size, head_dim)``
        (fused: ``(layers, 1, kv_heads, page_size, head_dim + value_dim)``), or its values
        flat when its rows differ in shape (``uniform``)."""
        if not self.uniform:
            return (sum(math.prod(shape) for shape in self.block_shapes()),)
        shape = self.blocks[0].shape if self.blocks else RowShape(self.num_kv_heads, self.head_dim, self.head_dim)
        return shape.array(self.num_layers, self.page_size)

    @cached_property
    def storage_dtype(self) -> np.dtype:
        """Numpy dtype with the same bytes (bfloat16 travels as uint16)."""
        return np.dtype(_NUMPY_STORAGE[self.dtype])

    @cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.storage_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.nbytes // self.page_size
