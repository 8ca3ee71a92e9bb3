"""The L3 page record (DESIGN §4), the same in every backend (LMDB, Redis).

A record is ``u32 little-endian header length | msgpack header | payload``. The header
is ``{"v": format version, "ns": namespace digest, "tok": token ids as <u4 bytes,
"codec": "raw" | "zstd" | "zstd-shuffle", "n": raw length, "xxh": xxh3_64 of the raw
bytes}``, and a writer may add ``"pad"``: zero bytes that place the payload where its
backend keeps it aligned (readers ignore keys they do not know); dtype and shape are
implied by the namespace and the raw length. The payload is the raw bytes or a zstd
frame (of the 2-byte planes for zstd-shuffle).

A record is served only when its header names this format version, this namespace and
these token ids, and its payload decodes to the raw length with this checksum; anything
else raises ``CorruptRecord`` (the backend deletes such a record and counts it).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import astuple, dataclass

import msgpack
import numpy as np
import zstandard
from xxhash import xxh3_64_intdigest

from ..layout import SLOT_OFFSET as RAW_PAYLOAD_OFFSET

FORMAT_VERSION = 1
CODECS = ("raw", "zstd", "zstd-shuffle")
_LEN = struct.Struct("<I")
_PAD_FIELD = len(msgpack.packb({"pad": b""})) - 1  # bytes the "pad" key adds with no padding


class CorruptRecord(ValueError):
    """A stored record that must not be served; the message says why."""


@dataclass(frozen=True)
class RecordHeader:
    version: int
    namespace: bytes
    tokens: bytes
    codec: str
    raw_len: int
    checksum: int

    def pack(self, pad: int = 0) -> bytes:
        """The header's bytes, ``pad`` bytes longer than without padding."""
        fields = dict(zip(("v", "ns", "tok", "codec", "n", "xxh"), astuple(self)))
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
            values = (f["v"], f["ns"], f["tok"], f["codec"], f["n"], f["xxh"])
        except Exception as exc:  # msgpack raises many types on garbage
            raise CorruptRecord(f"header does not parse ({type(exc).__name__})") from None
        if tuple(map(type, values)) != (int, bytes, bytes, str, int, int):
            raise CorruptRecord("header field of the wrong type")
        if f.get("pad", b"").strip(b"\0"):
            raise CorruptRecord("header padding is not zeros")
        return cls(*values), end


@dataclass
class StoredRecord:
    """A page record found in a snapshot: header checked, payload not yet verified."""

    key: bytes
    header: RecordHeader
    value: memoryview  # the whole record: in LMDB's map, or bytes read from Redis
    payload: memoryview

    @property
    def stored(self) -> int:
        """Bytes read from L3 for this page (D of the L3 link)."""
        return len(self.value)

    @property
    def compressed(self) -> bool:
        return self.header.codec != "raw"


def token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)  # 10x faster than numpy for a page


def header_or_none(value: memoryview | bytes) -> RecordHeader | None:
    try:
        return RecordHeader.unpack(value)[0]
    except CorruptRecord:
        return None


def check_header(header: RecordHeader, namespace: bytes, tokens: bytes, raw_nbytes: int) -> None:
    """CorruptRecord unless the header describes this page of this namespace."""
    for ok, reason in (
        (header.version == FORMAT_VERSION, "format version differs"),
        (header.namespace == namespace, "namespace digest differs"),
        (header.tokens == tokens, "token ids differ"),
        (header.raw_len == raw_nbytes, "raw length differs"),
        (header.codec in CODECS, "unknown codec"),
    ):
        if not ok:
            raise CorruptRecord(reason)


def checked_record(
    key: bytes, value: memoryview | bytes, namespace: bytes, tokens: Sequence[int], raw_nbytes: int
) -> StoredRecord:
    """The record of a stored value whose header matches this page; CorruptRecord otherwise."""
    value = memoryview(value)
    header, offset = RecordHeader.unpack(value)
    check_header(header, namespace, token_bytes(tokens), raw_nbytes)
    if header.codec == "raw" and len(value) - offset != raw_nbytes:
        raise CorruptRecord("raw payload length differs from the raw length")
    return StoredRecord(bytes(key), header, value, value[offset:])


def encode_record(namespace: bytes, tokens: bytes, raw: bytes, codec: str, level: int, at: int | None = None) -> bytes:
    """The stored value of a page (``tokens`` as <u4 bytes). ``at``: where the backend
    places the value within a 4 KiB page, if it knows; a raw payload then starts at
    ``RAW_PAYLOAD_OFFSET`` modulo 64 (see ``tiers.layout.slot_arena``: copies from it into
    mlx's arrays pair aligned loads with aligned stores)."""
    codec, body = encode_payload(codec, raw, level)
    header = RecordHeader(FORMAT_VERSION, namespace, tokens, codec, len(raw), xxh3_64_intdigest(raw))
    packed = header.pack() if at is None or codec != "raw" else header.pack_aligned(at, 64, RAW_PAYLOAD_OFFSET)
    return b"".join((packed, body))


def verify_payload(
    header: RecordHeader, payload: memoryview, out: np.ndarray | None = None
) -> memoryview | np.ndarray | bytes:
    """The raw bytes of a payload under a checked header (see ``decode_payload`` for
    ``out``); CorruptRecord unless they have the header's length and checksum."""
    raw = decode_payload(header.codec, payload, header.raw_len, out)
    view = raw.data if isinstance(raw, np.ndarray) else raw  # .data: tiers.join says why
    if len(raw) != header.raw_len or xxh3_64_intdigest(view) != header.checksum:
        raise CorruptRecord("checksum mismatch")
    return raw


def decode_record(
    value: memoryview, namespace: bytes, tokens: bytes, raw_nbytes: int, out: np.ndarray | None = None
) -> memoryview | np.ndarray | bytes:
    """The raw page of a stored value, checked against the page it should hold
    (namespace, token ids as <u4 bytes, raw length); CorruptRecord otherwise."""
    header, offset = RecordHeader.unpack(value)
    check_header(header, namespace, tokens, raw_nbytes)
    return verify_payload(header, value[offset:], out)


def _shuffle(raw: bytes) -> bytes:
    """Low bytes of the 2-byte values, then high bytes (bf16 sign+exponent compress well)."""
    words = np.frombuffer(raw, "<u2")
    return np.concatenate([(words & 0xFF).astype(np.uint8), (words >> 8).astype(np.uint8)]).tobytes()


def _unshuffle(planes: bytes) -> bytes:
    low, high = np.frombuffer(planes, np.uint8).reshape(2, -1)  # ValueError when odd
    return (low | high.astype("<u2") << 8).tobytes()


_local = threading.local()  # zstd (de)compressors are not thread-safe: one per thread


def encode_payload(codec: str, raw: bytes, level: int) -> tuple[str, bytes]:
    """The codec actually used and the payload; raw when compression does not pay."""
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
