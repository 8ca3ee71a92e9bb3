"""The L3 page record (DESIGN §4), the same in every backend (LMDB, Redis).

A record is ``u32 little-endian header length | msgpack header | payload``. The header
is ``{"v": record format version (``RECORD_VERSION``), "key": the record's own 16-byte
page key, "ns": namespace digest, "tok": token ids as <u4 bytes, "codec": "raw" | "zstd"
| "zstd-shuffle" | "q8" | "q4" | "k8v4", "n": raw length, "xxh": xxh3_64 of the raw bytes
(of the stored payload for a quantized codec)}``, and a writer may
add ``"pad"``: zero bytes that place the payload where its backend keeps it aligned
(readers ignore keys they do not know); dtype and shape are implied by the namespace and
the raw length. A page of a model with sliding-window layers adds ``"seg"``: ``[length,
xxh3_64]`` of each segment of the raw bytes (global rows, window rows:
``tiers.page.PageGeometry.segments``), so that a restore reading one segment of a raw
record checks it without reading the other. The payload is the raw bytes or a zstd frame
(of the 2-byte planes for zstd-shuffle), or a quantized page (``QUANTIZED``: lossy, see
``tiers.quant``). A quantized page does not decode to the bytes that were computed, so
its checksum is over the bytes stored, checked before it is decoded, and it has no
``"seg"`` (it is always decoded whole). This module needs no mlx: the caller quantizes
(``Quantize``) and dequantizes (``Dequantize``); without a quantizer a page is stored
raw, and without a dequantizer a quantized record is not served.

A record is served only when its header names this format version, the very key it was
looked up under, this namespace and these token ids, and its payload decodes to the raw
length with this checksum; anything else raises ``CorruptRecord`` (the backend deletes
such a record and counts it). The key is what binds a record to its place: a page key
chains the parent's key with the page's tokens (``tiers.page``), so it commits to the whole
prefix and the namespace, which the tokens and namespace alone do not. Without it a record
of another prefix whose page has the same tokens, copied under this key (an LMDB file
edited, any client of a shared Redis), passed every check and was served as this page.
The check is ``check_header``, which every read of every backend passes through
(``checked_record``, from ``Snapshot.find``) before a byte of the payload is used. The
unkeyed checksum detects damage, not forgery: a writer who can put records can compute it.

An encrypted record (``--encrypt-l3``, ``tiers.l3.cipher``) adds ``"nonce"`` and
``"ntok"`` (its token count), holds ``"tok": b""`` and ``"xxh": 0`` (no digest of the
raw bytes: it would confirm a guessed page), and its payload is AES-GCM of the codec's
output with the page key, the header's bytes and the token ids as associated data
(``sealed_record``); its tag is the check. A reader with a key serves only encrypted
records, one without serves none.

``FORMAT_VERSION`` is the store's layout (its tables, kept in meta); records carry their
own ``RECORD_VERSION``, so a store of older records still opens and refuses each such
record the first time it is read ("format version differs": counted, deleted, recomputed).
Version 1 records had no ``key``.
"""

from __future__ import annotations

import itertools
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass

import msgpack
import numpy as np
import zstandard
from xxhash import xxh3_64_intdigest

from ..layout import SLOT_OFFSET as RAW_PAYLOAD_OFFSET
from .cipher import TAG_BYTES, RecordCipher

FORMAT_VERSION = 1  # the store's layout (meta ``format_version``), not the records'
RECORD_VERSION = 2  # the header's ``v``: 2 added ``key``
QUANTIZED = ("q8", "q4", "k8v4")  # lossy: keys and values quantized (tiers.quant)
CODECS = ("raw", "zstd", "zstd-shuffle", *QUANTIZED)
Quantize = Callable[[str, bytes], bytes]  # (codec, raw page) -> payload
Dequantize = Callable[[str, memoryview, int, np.ndarray | None], np.ndarray]  # (codec, payload, raw length, out)
_LEN = struct.Struct("<I")
_FIELDS = ("v", "key", "ns", "tok", "codec", "n", "xxh")  # the header's keys, in RecordHeader's order
_PAD_FIELD = len(msgpack.packb({"pad": b""})) - 1  # bytes the "pad" key adds with no padding


class CorruptRecord(ValueError):
    """A stored record that must not be served; the message says why."""


@dataclass(frozen=True)
class RecordHeader:
    version: int
    key: bytes  # the page key the record was written under
    namespace: bytes
    tokens: bytes
    codec: str
    raw_len: int
    checksum: int
    segments: tuple[tuple[int, int], ...] = ()  # (length, xxh3_64) of each segment; () when one
    nonce: bytes = b""  # an encrypted record's AES-GCM nonce; b"": not encrypted
    sealed_tokens: int = 0  # an encrypted record's token count (its token ids are not stored)

    @property
    def token_count(self) -> int:
        return self.sealed_tokens if self.nonce else len(self.tokens) // 4

    def pack(self, pad: int = 0) -> bytes:
        """The header's bytes, ``pad`` bytes longer than without padding."""
        fields = dict(zip(_FIELDS, astuple(self)[: len(_FIELDS)]))
        if self.segments:
            fields["seg"] = [list(s) for s in self.segments]
        if self.nonce:
            fields["nonce"], fields["ntok"] = self.nonce, self.sealed_tokens
        if pad:
            fields["pad"] = bytes(pad - _PAD_FIELD)
        head = msgpack.packb(fields)
        return _LEN.pack(len(head)) + head

    def pack_aligned(self, at: int, alignment: int, offset: int) -> bytes:
        """The header's bytes for a value placed ``at`` bytes past an ``alignment``
        boundary: its payload then starts ``offset`` past such a boundary."""
        pad = (offset - at - len(self.pack())) % alignment
        pad = pad + alignment if 0 < pad < _PAD_FIELD else pad
        return self.pack(pad)

    @classmethod
    def unpack(cls, value: memoryview | bytes) -> tuple[RecordHeader, int]:
        """The header of a stored value and the payload offset; CorruptRecord if malformed."""
        end = _LEN.size + (_LEN.unpack_from(value)[0] if len(value) >= _LEN.size else len(value))
        if end > len(value):
            raise CorruptRecord("header runs past the record")
        try:
            f = msgpack.unpackb(value[_LEN.size : end])
            values = (f["v"], f.get("key", b""), f["ns"], f["tok"], f["codec"], f["n"], f["xxh"])  # v1: no key
            segments = tuple((int(n), int(x)) for n, x in f.get("seg", ()))
            sealing = (f.get("nonce", b""), f.get("ntok", 0))
        except Exception as exc:  # msgpack raises many types on garbage
            raise CorruptRecord(f"header does not parse ({type(exc).__name__})") from None
        if tuple(map(type, values + sealing)) != (int, bytes, bytes, bytes, str, int, int, bytes, int):
            raise CorruptRecord("header field of the wrong type")
        if segments and sum(n for n, _ in segments) != values[5]:
            raise CorruptRecord("segments do not add up to the raw length")
        if f.get("pad", b"").strip(b"\0"):
            raise CorruptRecord("header padding is not zeros")
        return cls(*values, segments, *sealing), end


def first_segment_end(value: memoryview | bytes) -> int | None:
    """Where the first segment of a stored raw record of several segments ends (its header
    and the page's global rows: ``tiers.page.PageGeometry.segments``), counted from the
    record's start; None for a record read whole (one segment, compressed, quantized or
    encrypted) or one whose header does not parse (its check rejects it)."""
    try:
        header, offset = RecordHeader.unpack(value)
    except CorruptRecord:
        return None
    if len(header.segments) < 2 or header.codec != "raw" or header.nonce:
        return None
    return offset + header.segments[0][0]


def fingerprinted(value: memoryview | bytes) -> memoryview:
    """The part of a stored value that names it for a delete-if-unchanged (each backend's
    fingerprint digests it): a raw record of several segments up to the end of its
    first, what every reader of it holds (a read ahead may hold no more:
    ``first_segment_end``); any other value whole."""
    return memoryview(value)[: first_segment_end(value) or len(value)]


@dataclass
class StoredRecord:
    """A page record found in a snapshot: header checked, payload not yet verified."""

    key: bytes
    header: RecordHeader
    value: memoryview  # the whole record: in LMDB's map, or bytes read from Redis
    payload: memoryview
    tokens: bytes  # the page's token ids as looked up (<u4 bytes): an encrypted record's tag covers them

    @property
    def stored(self) -> int:
        """Bytes read from L3 for this page (D of the L3 link)."""
        return len(self.value)

    @property
    def compressed(self) -> bool:
        """The payload must be decoded whole before use (compressed, or encrypted): it is
        never read in place, nor checked segment by segment."""
        return self.header.codec != "raw" or bool(self.header.nonce)

    @property
    def associated(self) -> bytes:
        """What an encrypted record's tag also authenticates: the key it was looked up
        under, its header's bytes and the page's token ids."""
        return self.key + bytes(self.value[: len(self.value) - len(self.payload)]) + self.tokens

    def segment_checksum(self, index: int) -> int:
        """xxh3_64 of raw segment ``index`` (CorruptRecord when the header has none)."""
        if index >= len(self.header.segments):
            raise CorruptRecord("record has no checksum for this segment")
        return self.header.segments[index][1]


def token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)  # 10x faster than numpy for a page


def header_or_none(value: memoryview | bytes) -> RecordHeader | None:
    try:
        return RecordHeader.unpack(value)[0]
    except CorruptRecord:
        return None


def check_header(
    header: RecordHeader, key: bytes, namespace: bytes, tokens: bytes, raw_nbytes: int, encrypted: bool = False
) -> None:
    """CorruptRecord unless the header describes the page looked up under ``key`` (the
    version first: an older record's other fields mean nothing), encrypted exactly when
    the reader holds a key (``encrypted``): an encrypted store serves no plain record,
    which anyone who can write the store could forge."""
    sealed = bool(header.nonce)
    for ok, reason in (
        (header.version == RECORD_VERSION, "format version differs"),
        (header.key == key, "page key differs"),
        (sealed or not encrypted, "record is not encrypted"),
        (encrypted or not sealed, "record is encrypted and this store has no key"),
        (header.namespace == namespace, "namespace digest differs"),
        (header.tokens == (b"" if sealed else tokens), "token ids differ"),
        (header.token_count == len(tokens) // 4, "token count differs"),
        (header.raw_len == raw_nbytes, "raw length differs"),
        (header.codec in CODECS, "unknown codec"),
    ):
        if not ok:
            raise CorruptRecord(reason)


def checked_record(
    key: bytes,
    value: memoryview | bytes,
    namespace: bytes,
    tokens: Sequence[int],
    raw_nbytes: int,
    encrypted: bool = False,
) -> StoredRecord:
    """The record of a stored value whose header matches this page (``encrypted``: the
    reader holds a key); CorruptRecord otherwise."""
    value, own = memoryview(value), token_bytes(tokens)
    header, offset = RecordHeader.unpack(value)
    check_header(header, bytes(key), namespace, own, raw_nbytes, encrypted)
    if header.codec == "raw" and len(value) - offset - (TAG_BYTES if header.nonce else 0) != raw_nbytes:
        raise CorruptRecord("raw payload length differs from the raw length")
    return StoredRecord(bytes(key), header, value, value[offset:], own)


def encode_record(
    key: bytes,
    namespace: bytes,
    tokens: bytes,
    raw: bytes,
    codec: str,
    level: int,
    at: int | None = None,
    segments: Sequence[int] = (),
    cipher: RecordCipher | None = None,
    quantize: Quantize | None = None,
) -> bytes:
    """The stored value of the page keyed ``key`` (``tokens`` as <u4 bytes). ``at``: where the backend
    places the value within a 4 KiB page, if it knows; a raw payload then starts at
    ``RAW_PAYLOAD_OFFSET`` modulo 64 (see ``tiers.layout.slot_arena``: copies from it into
    mlx's arrays pair aligned loads with aligned stores). ``segments``: byte lengths
    of the raw bytes' segments, each checksummed apart (module docstring). With a
    ``cipher`` the token ids and the payload are sealed instead (``sealed_record``).
    ``quantize``: how a quantized codec encodes this page (none: stored raw)."""
    codec, body = encode_payload(codec, raw, level, quantize)
    if cipher is not None:
        return sealed_record(key, namespace, tokens, codec, len(raw), body, cipher)
    lossy, view, bounds = codec in QUANTIZED, memoryview(raw), [0, *itertools.accumulate(segments)]
    checks = () if lossy else tuple((b - a, xxh3_64_intdigest(view[a:b])) for a, b in zip(bounds, bounds[1:]))
    checksum = xxh3_64_intdigest(body if lossy else raw)
    header = RecordHeader(RECORD_VERSION, key, namespace, tokens, codec, len(raw), checksum, checks)
    packed = header.pack() if at is None or codec != "raw" else header.pack_aligned(at, 64, RAW_PAYLOAD_OFFSET)
    return b"".join((packed, body))


def sealed_record(
    key: bytes, namespace: bytes, tokens: bytes, codec: str, raw_len: int, body: bytes, cipher: RecordCipher
) -> bytes:
    """An encrypted record: a header without token ids or checksums, then AES-GCM of the
    payload with the page key, the header's bytes and the token ids as associated data.
    The token ids are not stored (the key commits to them, the tag covers them); a
    digest of the raw bytes would let whoever reads the store confirm a guessed page.
    A window model's segments are not checksummed apart: the record is decrypted
    whole, then used."""
    nonce = cipher.nonce()
    header = RecordHeader(RECORD_VERSION, key, namespace, b"", codec, raw_len, 0, (), nonce, len(tokens) // 4)
    packed = header.pack()
    return packed + cipher.seal(namespace, key, nonce, body, key + packed + tokens)


def record_bytes(
    record: StoredRecord,
    out: np.ndarray | None = None,
    cipher: RecordCipher | None = None,
    dequantize: Dequantize | None = None,
) -> memoryview | np.ndarray | bytes:
    """The raw bytes of a checked record (see ``decode_payload`` for ``out``), decrypted
    first when it is encrypted: a raw one straight into ``out``; CorruptRecord when its
    tag or checksum does not hold."""
    header = record.header
    if not header.nonce:
        return verify_payload(header, record.payload, out, dequantize)
    assert cipher is not None, "an encrypted record passed its header check without a key"
    into = out if header.codec == "raw" else None
    plain = cipher.open(header.namespace, record.key, header.nonce, record.payload, record.associated, into)
    if plain is None:
        raise CorruptRecord("authentication failed")
    if isinstance(plain, np.ndarray):  # decrypted into ``out``: a raw payload, checked by its tag
        return plain
    return verify_payload(header, memoryview(plain), out, dequantize)


def verify_payload(
    header: RecordHeader, payload: memoryview, out: np.ndarray | None = None, dequantize: Dequantize | None = None
) -> memoryview | np.ndarray | bytes:
    """The raw bytes of a payload under a checked header (see ``decode_payload`` for
    ``out``); CorruptRecord unless they have the header's length and checksum (an
    encrypted record's payload, already authenticated, has no checksum). A quantized
    payload's checksum is over the payload, checked before ``dequantize`` decodes it."""
    if header.codec in QUANTIZED:
        if not header.nonce and xxh3_64_intdigest(payload) != header.checksum:
            raise CorruptRecord("checksum mismatch")
        if dequantize is None:
            raise CorruptRecord("quantized record and no dequantizer")
        return dequantize(header.codec, payload, header.raw_len, out)
    raw = decode_payload(header.codec, payload, header.raw_len, out)
    view = raw.data if isinstance(raw, np.ndarray) else raw  # .data: tiers.join says why
    if len(raw) != header.raw_len or (not header.nonce and xxh3_64_intdigest(view) != header.checksum):
        raise CorruptRecord("checksum mismatch")
    return raw


def decode_record(
    key: bytes,
    value: memoryview,
    namespace: bytes,
    tokens: bytes,
    raw_nbytes: int,
    out: np.ndarray | None = None,
    dequantize: Dequantize | None = None,
) -> memoryview | np.ndarray | bytes:
    """The raw page of a stored value, checked against the page it should hold (its key,
    namespace, token ids as <u4 bytes, raw length); CorruptRecord otherwise."""
    header, offset = RecordHeader.unpack(value)
    check_header(header, key, namespace, tokens, raw_nbytes)
    return verify_payload(header, value[offset:], out, dequantize)


def _shuffle(raw: bytes) -> bytes:
    """Low bytes of the 2-byte values, then high bytes (bf16 sign+exponent compress well)."""
    words = np.frombuffer(raw, "<u2")
    return np.concatenate([(words & 0xFF).astype(np.uint8), (words >> 8).astype(np.uint8)]).tobytes()


def _unshuffle(planes: bytes) -> bytes:
    low, high = np.frombuffer(planes, np.uint8).reshape(2, -1)  # ValueError when odd
    return (low | high.astype("<u2") << 8).tobytes()


_local = threading.local()  # zstd (de)compressors are not thread-safe: one per thread


def encode_payload(codec: str, raw: bytes, level: int, quantize: Quantize | None = None) -> tuple[str, bytes]:
    """The codec actually used and the payload; raw when compression does not pay, and
    for a quantized codec without ``quantize`` (what is not a page: a snapshot)."""
    if codec in QUANTIZED:
        return (codec, quantize(codec, raw)) if quantize is not None else ("raw", raw)
    codec = "zstd" if codec == "zstd-shuffle" and len(raw) % 2 else codec
    if codec == "raw":
        return codec, raw
    if getattr(_local, "level", None) != level:
        _local.compressor, _local.level = zstandard.ZstdCompressor(level=level), level
    packed = _local.compressor.compress(_shuffle(raw) if codec == "zstd-shuffle" else raw)
    return (codec, packed) if len(packed) < len(raw) else ("raw", raw)


def decode_payload(
    codec: str, payload: memoryview, raw_len: int, out: np.ndarray | None = None
) -> memoryview | bytes | np.ndarray:
    """Raw bytes of a payload, written into ``out`` when given; without ``out`` a raw
    payload is returned as it is (a view, no copy); CorruptRecord if it cannot be decoded."""
    if out is not None:
        if len(payload) != raw_len and codec == "raw":
            raise CorruptRecord("raw payload length differs from the raw length")
        raw = payload if codec == "raw" else decode_payload(codec, payload, raw_len)
        np.copyto(out, np.frombuffer(raw, np.uint8))
        return out
    if codec == "raw":
        return payload
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    try:
        if zstandard.frame_content_size(payload) != raw_len:  # bounds memory before decoding
            raise CorruptRecord("zstd frame size differs from the raw length")
        data = _local.decompressor.decompress(payload)
        return _unshuffle(data) if codec == "zstd-shuffle" else data
    except (zstandard.ZstdError, ValueError) as exc:
        raise CorruptRecord(f"payload does not decode ({exc})") from None
