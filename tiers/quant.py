"""Quantizing page codecs (``q8``, ``q4``, ``k8v4``): mlx's own affine quantization
(``mx.quantize`` / ``mx.dequantize``, groups of ``GROUP`` values) of a page's keys and
values, each with its own bits.

These codecs are lossy: a page decoded is close to, never equal to, the page that was
computed. Keys and values are quantized apart (a page is ``(layers, 2, kv_heads,
page_size, head_dim)``: K then V within a layer), in groups of 64 consecutive values of
each layer's K (or V) in C order: one token's head vector when ``head_dim`` is 64, as
mlx-lm's own quantized KV cache groups them. Device compute stays in full precision:
only the offloaded copy is quantized.

A payload is a fixed prefix, ``PREFIX`` (dtype code, key bits, value bits, group size,
layers), then K's packed words, scales and biases, then V's. The prefix makes a payload
self-describing, so a reader needs only the record (its raw length, the page's bytes
once decoded); a payload whose prefix or length does not fit that raw length is
``CorruptRecord``. Which codec a page is stored with is part of the namespace
(``tiers.page.Namespace.codecs``): a quantized page's key never names a raw page's,
nor a q4 page's a q8 one's.

Only whole pages are quantized (``PageLayout`` names their layers and dtype); the
recurrent state of a hybrid model's snapshots is stored losslessly: it is carried from
token to token, so an error in it is not bounded by one rounding but compounds over
every later token, and a snapshot is small beside the pages it follows.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .l3.record import QUANTIZED, CorruptRecord, Quantize
from .page import PageGeometry

GROUP = 64  # values per quantization group (one scale and one bias each)
BITS = dict(zip(QUANTIZED, ((8, 8), (4, 4), (8, 4))))  # codec -> (key bits, value bits)
PREFIX = struct.Struct("<BBBBI")  # dtype code, key bits, value bits, group, layers
_DTYPES = ("bfloat16", "float16", "float32")
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
_STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}  # a page's values in numpy
_CHUNK = 512 << 10  # bytes of a page's half decoded at a time (``dequantize``)


@dataclass(frozen=True)
class PageLayout:
    """What a quantizing codec needs to know of a page: its attention layers and dtype."""

    layers: int
    dtype: str

    def check(self, raw_nbytes: int) -> None:
        """ValueError unless a page of ``raw_nbytes`` splits into groups of ``GROUP``
        values of K and of V in every layer."""
        per_half, rest = divmod(raw_nbytes, 2 * self.layers * _ITEMSIZE[self.dtype])
        if rest or per_half % GROUP:
            raise ValueError(
                f"a quantized codec needs each layer's keys in groups of {GROUP} values "
                f"(kv heads x page size x head dim): {per_half} is not a multiple"
            )


def is_quantized(codec: str) -> bool:
    return codec in BITS


def stored_nbytes(codec: str, raw_nbytes: int, dtype: str) -> int:
    """Bytes of a page's quantized payload (prefix included); ``raw_nbytes`` for a
    codec that does not quantize."""
    if codec not in BITS:
        return raw_nbytes
    itemsize = _ITEMSIZE[dtype]
    values = raw_nbytes // itemsize // 2  # of K, and of V
    return PREFIX.size + sum(_part_nbytes(values, bits, itemsize) for bits in BITS[codec])


def _part_nbytes(values: int, bits: int, itemsize: int) -> int:
    return values * bits // 8 + 2 * (values // GROUP) * itemsize  # words, scales, biases


def _as_mx(data: np.ndarray, dtype: str) -> mx.array:
    """An mlx array of these bytes as ``dtype`` (bfloat16 travels as uint16)."""
    if dtype == "bfloat16":
        return mx.array(data.view(np.uint16)).view(mx.bfloat16)
    return mx.array(data.view(np.float16 if dtype == "float16" else np.float32))


def _as_bytes(array: mx.array) -> np.ndarray:
    """An mlx array's bytes, uint8 (a view where mlx allows)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.asarray(array).reshape(-1).view(np.uint8)


def encode(codec: str, raw: bytes | memoryview | np.ndarray, layout: PageLayout) -> bytes:
    """The quantized payload of one raw page."""
    flat = np.frombuffer(raw, np.uint8)
    layout.check(flat.size)
    data = flat.reshape(layout.layers, 2, -1)
    parts = [PREFIX.pack(_DTYPES.index(layout.dtype), *BITS[codec], GROUP, layout.layers)]
    for half, bits in enumerate(BITS[codec]):
        values = _as_mx(np.ascontiguousarray(data[:, half]).reshape(-1), layout.dtype).reshape(-1, GROUP)
        words, scales, biases = mx.quantize(values, GROUP, bits)
        mx.eval(words, scales, biases)
        parts += [_as_bytes(a).tobytes() for a in (words, scales, biases)]
    return b"".join(parts)


def decode(codec: str, payload: memoryview | bytes, raw_nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
    """The raw page (uint8, ``raw_nbytes``) of a quantized payload, dequantized straight
    into ``out`` when given (no other full-size host copy); CorruptRecord when the
    payload cannot be this page's. The bytes are ``mx.dequantize``'s (``dequantize``)."""
    payload = memoryview(payload).cast("B")
    if len(payload) < PREFIX.size:
        raise CorruptRecord("quantized payload shorter than its prefix")
    code, kbits, vbits, group, layers = PREFIX.unpack_from(payload)
    if code >= len(_DTYPES) or (kbits, vbits) != BITS.get(codec) or group != GROUP or not layers:
        raise CorruptRecord("quantized payload's prefix does not match its codec")
    dtype = _DTYPES[code]
    try:
        PageLayout(layers, dtype).check(raw_nbytes)
    except ValueError:
        raise CorruptRecord("quantized payload's layers do not divide the raw length") from None
    if len(payload) != stored_nbytes(codec, raw_nbytes, dtype):
        raise CorruptRecord("quantized payload length differs from its raw length's")
    itemsize, values = _ITEMSIZE[dtype], raw_nbytes // _ITEMSIZE[dtype] // 2
    target = np.empty(raw_nbytes, np.uint8) if out is None else out
    rows = target.view(_STORAGE[dtype]).reshape(layers, 2, -1)
    at = PREFIX.size
    for half, bits in enumerate((kbits, vbits)):
        sizes = (values * bits // 8, (values // GROUP) * itemsize, (values // GROUP) * itemsize)
        words, scales, biases = (np.frombuffer(payload, np.uint8, n, at + sum(sizes[:i])) for i, n in enumerate(sizes))
        at += sum(sizes)
        dequantize(words, scales, biases, bits, dtype, rows[:, half])
    return target


def dequantize(
    words: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, dtype: str, out: np.ndarray
) -> None:
    """``mx.dequantize(words, scales, biases, GROUP, bits)`` of one half of a page (its
    K, or its V), bytes for bytes, into ``out`` (``(layers, values)``, the page's rows
    of that half, in its storage dtype); ``words``, ``scales``, ``biases`` are uint8
    views of the payload's parts.

    Why not ``mx.dequantize`` itself: on a CPU it costs several memcpys of the page
    (``bench/codec_decode.py``). mlx's affine decode is ``scale * q + bias``, two
    rounded operations in the page's dtype (no fused multiply-add), and numpy's float32
    and float16 arithmetic rounds each the same way, so ``q * scale`` then ``+ bias``
    into ``out`` gives its bytes; bfloat16, which numpy lacks, is computed by mlx's own
    elementwise operations, the same two, and copied into ``out``. A few layers at a
    time (``_CHUNK`` bytes of ``out``), so the add reads what the multiply just wrote
    from the core's cache rather than from memory. A 4-bit byte holds two values, the
    first in its low nibble (mlx packs values from the least significant bits up)."""
    layers, per_layer = out.shape
    groups = per_layer // GROUP
    codes = words.reshape(layers, groups, GROUP * bits // 8)
    # a payload lies at any byte offset (in LMDB's map, after its header): numpy's loops
    # over unaligned floats are several times slower, so the scales and biases (1/32 of
    # the bytes they decode to) are copied aligned when they are not
    scale = np.require(scales.view(_STORAGE[dtype]), requirements="A").reshape(layers, groups, 1)
    bias = np.require(biases.view(_STORAGE[dtype]), requirements="A").reshape(layers, groups, 1)
    step = max(1, _CHUNK // (per_layer * _ITEMSIZE[dtype]))
    for a in range(0, layers, step):
        b = min(a + step, layers)
        q = codes[a:b] if bits == 8 else np.stack((codes[a:b] & 0xF, codes[a:b] >> 4), axis=-1)
        q = q.reshape(b - a, groups, GROUP)
        dst = out[a:b].reshape(b - a, groups, GROUP)
        if dtype == "bfloat16":
            plain = mx.array(q).astype(mx.bfloat16) * _as_mx(scale[a:b], dtype) + _as_mx(bias[a:b], dtype)
            np.copyto(dst, np.asarray(plain.view(mx.uint16)))
        else:
            np.multiply(q, scale[a:b], out=dst)
            np.add(dst, bias[a:b], out=dst)


def namespace_codecs(l3: str, l2: str = "raw") -> str:
    """What a namespace digests of its tiers' codecs (``Namespace.codecs``): each lossy
    one, by tier (``"L2:q8,L3:q8"``); empty when every tier keeps the bytes computed, so
    a lossless store's keys are what they always were."""
    return ",".join(f"{tier}:{codec}" for tier, codec in (("L2", l2), ("L3", l3)) if codec in BITS)


def page_quantizer(geometry: PageGeometry, codec: str) -> Quantize | None:
    """How ``codec`` encodes one of these pages (None: it does not quantize); ValueError
    when its pages do not split into groups of ``GROUP``."""
    page = PageCodec.of(geometry, codec)
    return page.encode if page is not None else None


@dataclass(frozen=True)
class PageCodec:
    """A quantizing codec for the pages of one geometry (an L2 that quantizes its pages,
    ``tiers.tier.HostTier``; a quantizing L3's writes)."""

    name: str
    layout: PageLayout
    raw_nbytes: int

    @classmethod
    def of(cls, geometry: PageGeometry, codec: str) -> PageCodec | None:
        """``codec`` for these pages; None when it does not quantize; ValueError when its
        pages do not split into groups of ``GROUP``."""
        if codec not in BITS:
            return None
        if not geometry.uniform or geometry.fused:  # groups are cut by (layer, K or V): one row shape
            raise ValueError(
                f"the {codec} codec needs pages whose rows have one shape, keys as wide as values; "
                "this model's pages cannot be quantized"
            )
        layout = PageLayout(geometry.num_layers, geometry.dtype)
        layout.check(geometry.nbytes)
        return cls(codec, layout, geometry.nbytes)

    @property
    def stored_nbytes(self) -> int:
        return stored_nbytes(self.name, self.raw_nbytes, self.layout.dtype)

    def encode(self, codec: str, raw: bytes | memoryview | np.ndarray) -> bytes:
        """``Quantize`` for a record of this codec (``codec`` is the record's: this one)."""
        return encode(codec, raw, self.layout)

    def decode(self, payload: memoryview | bytes | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return decode(self.name, payload.data if isinstance(payload, np.ndarray) else payload, self.raw_nbytes, out)
