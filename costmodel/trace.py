"""Mooncake request traces, read for a replay (``costmodel.replay``) and its bounds
(``costmodel.bounds``).

A trace is one JSON object a line: ``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks, the last one possibly partial. A
block's hash id names its whole prefix, so equal ids are equal pages. Block ``h``
becomes 512 synthetic token ids derived from ``h`` (equal ids, equal tokens), so the
page keys chain exactly as a real prompt's do. Only the request's reusable full pages
(``(input_length - 1) // page_size``) are keyed, as in the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.tiers.page import Namespace, PageKey, page_keys, reusable_pages

BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that is not a Mooncake request (one clear line)."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: Path) -> list[TraceRequest]:
    """The requests of a Mooncake trace file, in file order; TraceError on a bad line."""
    requests = []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {getattr(exc, 'strerror', None) or exc}") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            requests.append(_parse(line, f"{path}:{number}"))
    if not requests:
        raise TraceError(f"trace {path} has no requests")
    return requests


def _parse(line: str, where: str) -> TraceRequest:
    try:
        d = json.loads(line)
        stamp, n, out, ids = d["timestamp"], d["input_length"], d["output_length"], d["hash_ids"]
    except (ValueError, TypeError, KeyError) as exc:
        raise TraceError(f"{where}: not a trace request ({type(exc).__name__}: {exc})") from None
    if (
        not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, out, *ids))
        or not isinstance(stamp, (int, float))
        or n < 1
        or out < 0
    ):
        raise TraceError(f"{where}: timestamp, input_length >= 1, output_length >= 0 and hash_ids must be numbers")
    if len(ids) != -(-n // BLOCK_TOKENS):
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for {n} tokens (expected ceil({n}/{BLOCK_TOKENS}) = {-(-n // BLOCK_TOKENS)})"
        )
    return TraceRequest(stamp / 1000.0, n, out, tuple(ids))


class SyntheticPrompts:
    """Token ids and page keys of trace requests: block ``h`` is the 512 ids
    ``d*512 .. d*512+511``, ``d`` the rank of ``h`` among the ids seen so far."""

    def __init__(self, namespace: Namespace) -> None:
        if BLOCK_TOKENS % namespace.page_size:
            raise ValueError(f"page size {namespace.page_size} does not divide {BLOCK_TOKENS}")
        self.namespace = namespace
        self.page_size = namespace.page_size
        self.dense: dict[int, int] = {}
        self._offsets = np.arange(BLOCK_TOKENS, dtype=np.uint32)

    def pages(self, request: TraceRequest) -> tuple[list[PageKey], list[int]]:
        """Keys of the request's reusable full pages and the tokens they hold."""
        n_pages = reusable_pages(request.input_length, self.page_size)
        blocks = -(-n_pages * self.page_size // BLOCK_TOKENS)
        dense = np.array(
            [self.dense.setdefault(h, len(self.dense)) for h in request.hash_ids[:blocks]], dtype=np.uint32
        )
        tokens = (dense[:, None] * BLOCK_TOKENS + self._offsets).reshape(-1)[: n_pages * self.page_size]
        return page_keys(self.namespace, tokens), tokens.tolist()


def page_names(request: TraceRequest, page_size: int) -> list[tuple[int, int]]:
    """Its reusable pages as (hash id of the block, page within the block): a block's
    hash id names its whole prefix, so equal names are equal pages."""
    per_block = BLOCK_TOKENS // page_size
    return [
        (request.hash_ids[i // per_block], i % per_block)
        for i in range(reusable_pages(request.input_length, page_size))
    ]
