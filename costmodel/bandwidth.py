"""Restore bandwidth per link and prefix length, beside the machine's physical limits and
mlx-lm's own prompt-cache files, all measured in one process: the one measuring module
behind ``kvtier bench restore`` and ``bench/restore_bandwidth.py``.

Every figure is the best of the same number of interleaved rounds: round r times every
row once (``timeit``, one call, after one untimed warm-up round) before round r+1
starts, so each ratio (to memcpy of the same bytes, to ``load_prompt_cache`` of the same
KV) compares times from the same stretch of the run: this kind of machine drifts.
A restore row times ``TieredStore.restore`` whole (the engine's path: lookups and pins,
L3 reads, checksums, the join into per-layer arrays, evaluated).
"""

from __future__ import annotations

import os
import tempfile
import timeit
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import zstandard
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from kvtier.tiers.hierarchy import RestoredPrefix, TieredStore
from kvtier.tiers.l3.cipher import RecordCipher
from kvtier.tiers.l3.secret import derive
from kvtier.tiers.links import Link
from kvtier.tiers.page import PageGeometry, PageKey, Source

from .calibrate import CONTEXTS, PREFILL_TOKENS, QUICK_REPEATS, prefill_samples, quick_grid, scratch_store
from .plan import plan_restore
from .profile import Profile

GIB = 1 << 30
PAGE_COUNTS = (1, 4, 16, 64)
ROUNDS = 7
QUICK_PAGE_COUNTS = (1, 4, 16)  # --quick: smaller scratch stores, fewer rows, fewer rounds,
QUICK_ROUNDS = 2  # and the quick calibration's prefill grid (its length scaled to the BLAS's speed)
# (row name prefix, codec, source of every restored page)
RESTORES = (("L2->L1", "raw", Source.L2), ("L3->L1", "raw", Source.L3), ("L3 zstd->L1", "zstd", Source.L3))
# --encrypt-l3: raw pages, AES-256-GCM encrypted in L3 (decrypted whole into L2, then joined);
# a row of its own, compared with "L3->L1" of the same rounds, and no link sample
ENCRYPTED = ("L3 aes->L1", "raw", Source.L3)


def restore_rows(encrypted: bool, codecs: tuple[str, ...] = ()) -> tuple[tuple[str, str, Source], ...]:
    """The rows measured: ``RESTORES``, the encrypted one, and one per quantizing codec
    of ``codecs`` (decoded into L2, then joined; compared with "L3->L1", no link sample)."""
    quantized = tuple((f"L3 {codec}->L1", codec, Source.L3) for codec in codecs)
    return RESTORES + ((ENCRYPTED,) if encrypted else ()) + quantized


def throwaway_cipher() -> RecordCipher:
    """A cipher under a fresh random secret: the cost of encryption, none of the operator's keys."""
    return RecordCipher(partial(derive, os.urandom(32), b"encrypt"), "bench")


Tick = Callable[[], None]


@dataclass
class Call:
    """One row of a run: ``run`` is timed; ``setup`` and ``teardown`` (not timed) run
    before and after each call."""

    run: Callable[[], object]
    setup: Callable[[], object] = lambda: None
    teardown: Callable[[], object] = lambda: None
    seconds: list[float] = field(default_factory=list)  # one per round

    @property
    def best(self) -> float:
        return min(self.seconds)


def interleaved(calls: dict[str, Call], rounds: int, tick: Tick = lambda: None) -> dict[str, Call]:
    """Time every call once per round, in order, round after round (after one untimed
    warm-up round); each call keeps its ``rounds`` timings. ``tick`` once per round."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    for call in calls.values():
        call.setup()
        call.run()
        call.teardown()
    for _ in range(rounds):
        for call in calls.values():
            call.seconds.append(timeit.Timer(call.run, call.setup).timeit(number=1))
            call.teardown()
        tick()
    return calls


class Memcpy:
    """numpy copies between two warm buffers of ``nbytes``: the first ``n`` bytes, on one
    thread or split over two."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # fault the destination in: we time the copy, not the kernel
        self.pool = ThreadPoolExecutor(2)

    def one_thread(self, n: int | None = None) -> None:
        np.copyto(self.dst[:n], self.src[:n])

    def two_threads(self, n: int | None = None) -> None:
        n = len(self.src) if n is None else n
        halves = (slice(0, n // 2), slice(n // 2, n))
        list(self.pool.map(lambda s: np.copyto(self.dst[s], self.src[s]), halves))


class Restores:
    """A scratch store holding ``pages`` pages in ``source`` (L2; or L3 only, with
    ``codec``); ``call(n)`` restores the first n of them, dropping L2's copies (decoded
    compressed pages) before each and releasing the restore (its arrays freed into
    mlx's buffer cache, as a finished request's) after each."""

    def __init__(self, store: TieredStore, keys: list[PageKey], tokens: list[int], source: Source) -> None:
        self.store, self.keys, self.tokens, self.source = store, keys, tokens, source
        self.last: RestoredPrefix | None = None
        if source is Source.L3:
            store.keeping.flush()
            store.keeping.drop_l2()

    def call(self, n: int) -> Call:
        return Call(lambda: self.restore(n), self.drop_l2, self.release)

    def drop_l2(self) -> None:
        if self.source is Source.L3:
            self.store.keeping.drop_l2()

    def release(self) -> None:
        if self.last is not None:
            self.store.release(self.last.keys)
            self.last = None

    def reset(self) -> None:
        self.release()
        self.drop_l2()

    def restore(self, n: int) -> RestoredPrefix:
        restored = self.store.restore(self.keys[:n], self.tokens)
        mx.eval([a for layer in restored.layers for a in layer])
        self.last = restored
        if restored.sources != [self.source] * n:  # a row must time what it names
            raise RuntimeError(
                f"restored {restored.num_pages}/{n} pages from {restored.sources}, wanted all from {self.source.value}"
            )
        return restored


def measure(
    geometry: PageGeometry,
    store_dir: Path,
    page_counts: tuple[int, ...] = PAGE_COUNTS,
    rounds: int = ROUNDS,
    tick: Tick = lambda: None,
    encrypted: bool = False,
    codecs: tuple[str, ...] = (),
) -> dict:
    """Restores per link and page count, memcpy (one and two threads) of the same bytes,
    and, on the whole prompt (the most pages): LMDB's zero-copy read, zstd decompression
    and ``load_prompt_cache`` of the same KV; every row timed in the same rounds.
    ``encrypted``: also restores of encrypted L3 pages, and their cost (``encryption``);
    ``codecs``: of L3 pages in these quantizing codecs (``restore_rows``)."""
    pages = max(page_counts)
    nbytes = pages * geometry.nbytes
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        restores = {}
        for name, codec, source in restore_rows(encrypted, codecs):
            cipher = throwaway_cipher() if name == ENCRYPTED[0] else None
            store, keys, tokens = stack.enter_context(scratch_store(geometry, store_dir, pages, codec, cipher))
            restores[name] = Restores(store, keys, tokens, source)
        raw_l3 = restores["L3->L1"]
        peer_path = _saved_prompt_cache(raw_l3.restore(pages), Path(tmp))
        raw_l3.reset()
        memcpy = Memcpy(nbytes)
        calls: dict[str, Call] = {}
        for n in page_counts:
            calls[f"memcpy {n}"] = Call(partial(memcpy.one_thread, n * geometry.nbytes))
            calls[f"memcpy2 {n}"] = Call(partial(memcpy.two_threads, n * geometry.nbytes))
            for name, restore in restores.items():
                calls[f"{name} {n}"] = restore.call(n)
        frame = zstandard.ZstdCompressor(level=3).compress(
            np.random.default_rng(0).standard_normal(geometry.nbytes // 4, dtype=np.float32).tobytes()
        )
        decompressor = zstandard.ZstdDecompressor()
        calls["lmdb_zero_copy_read"] = Call(lambda: raw_l3.store.accounts.read_through_l3(raw_l3.keys))
        calls["zstd_decompress"] = Call(lambda: [decompressor.decompress(frame) for _ in range(pages)])
        calls["load_prompt_cache"] = Call(lambda: mx.eval([c.state[:2] for c in load_prompt_cache(peer_path)]))
        tick()
        interleaved(calls, rounds, tick)
        compressed = _stored_bytes(restores["L3 zstd->L1"], page_counts)
        sealed = _stored_bytes(restores[ENCRYPTED[0]], page_counts) if encrypted else {}
        for restore in restores.values():
            restore.reset()
    report = _report(calls, geometry, page_counts, rounds, compressed, restore_rows(encrypted, codecs))
    if encrypted:
        report["encryption"] = [_encryption_cost(calls, n, sealed[n]) for n in page_counts]
    return report


def _encryption_cost(calls: dict[str, Call], pages: int, stored: int) -> dict:
    """Encrypted against plain raw L3 restores of ``pages`` pages (best of the same rounds);
    ``stored``: bytes the encrypted restore read from L3 (decrypted into L2: ``L3->L2``)."""
    plain, sealed = calls[f"L3->L1 {pages}"].best, calls[f"{ENCRYPTED[0]} {pages}"].best
    return {
        "pages": pages,
        "stored_bytes": stored,
        "plain_seconds": plain,
        "encrypted_seconds": sealed,
        "ratio": sealed / plain,
    }


def _stored_bytes(restores: Restores, page_counts: tuple[int, ...]) -> dict[int, int]:
    """Bytes read from L3 by a restore of n compressed (or encrypted) pages (the link's input size)."""
    stored = {}
    for n in page_counts:
        before = restores.store.stats().links[Link.L3_L2].bytes
        restores.reset()
        restores.restore(n)
        stored[n] = restores.store.stats().links[Link.L3_L2].bytes - before
    return stored


def _report(
    calls: dict[str, Call],
    geometry: PageGeometry,
    page_counts: tuple[int, ...],
    rounds: int,
    compressed: dict[int, int],
    restores: tuple[tuple[str, str, Source], ...],
) -> dict:
    rows = []
    for n in page_counts:
        nbytes = n * geometry.nbytes
        memcpy = calls[f"memcpy {n}"]
        for name, _, source in restores:
            call = calls[f"{name} {n}"]
            rows.append(
                {
                    "row": name,
                    "from": source.value,
                    "pages": n,
                    "bytes": nbytes,
                    "seconds": call.best,
                    "gib_s": nbytes / call.best / GIB,
                    "memcpy_seconds": memcpy.best,
                    "memcpy_gib_s": nbytes / memcpy.best / GIB,
                    "memcpy_2_threads_gib_s": nbytes / calls[f"memcpy2 {n}"].best / GIB,
                    "ratio_to_memcpy": memcpy.best / call.best,
                    "round_seconds": call.seconds,
                }
            )
    pages = max(page_counts)
    nbytes = pages * geometry.nbytes
    memcpy, ours, peer = calls[f"memcpy {pages}"], calls[f"L3->L1 {pages}"], calls["load_prompt_cache"]
    limits = {
        "bytes": nbytes,
        "memcpy_gib_s": nbytes / memcpy.best / GIB,
        "memcpy_2_threads_gib_s": nbytes / calls[f"memcpy2 {pages}"].best / GIB,
        "lmdb_zero_copy_read_gib_s": nbytes / calls["lmdb_zero_copy_read"].best / GIB,
        "zstd_decompress_gib_s": nbytes / calls["zstd_decompress"].best / GIB,
    }
    peer_report = {
        "bytes": nbytes,
        "pages": pages,
        "load_prompt_cache_seconds": peer.best,
        "load_prompt_cache_gib_s": nbytes / peer.best / GIB,
        "ours_l3_seconds": ours.best,
        "ours_l3_gib_s": nbytes / ours.best / GIB,
        "ratio": peer.best / ours.best,
        "round_seconds": peer.seconds,
    }
    return {
        "rounds": rounds,
        "restores": rows,
        "links": _link_samples(rows, compressed),
        "limits": limits,
        "peer": peer_report,
    }


def _link_samples(rows: list[dict], compressed: dict[int, int]) -> list[dict]:
    """(bytes, seconds) per link for the cost model: a restore from L2 or raw L3 crosses
    one link; a compressed L3 page crosses L3->L2 (its decode: the zstd restore less the
    L2 restore of as many pages, both best of the same rounds) then L2->L1."""
    by = {(r["row"], r["pages"]): r for r in rows}
    links = []
    for r in rows:
        if r["row"] not in {row[0] for row in RESTORES}:  # encrypted and quantized rows: compared, not fitted
            continue
        if r["row"] == "L3 zstd->L1":
            seconds = max(r["seconds"] - by["L2->L1", r["pages"]]["seconds"], 1e-9)
            links.append(
                {
                    "link": "L3->L2",
                    "pages": r["pages"],
                    "bytes": compressed[r["pages"]],
                    "seconds": seconds,
                    "gib_s": compressed[r["pages"]] / seconds / GIB,
                }
            )
        else:
            links.append(
                {
                    "link": r["row"],
                    "pages": r["pages"],
                    "bytes": r["bytes"],
                    "seconds": r["seconds"],
                    "gib_s": r["gib_s"],
                }
            )
    return links


def _saved_prompt_cache(restored: RestoredPrefix, directory: Path) -> str:
    """The restored KV saved as mlx-lm's prompt-cache file (safetensors)."""
    path = str(directory / "prompt.safetensors")
    save_prompt_cache(path, [_kv_cache(k, v) for k, v in restored.layers])
    return path


def _kv_cache(keys: mx.array, values: mx.array) -> KVCache:
    cache = KVCache()
    cache.state = (keys, values, keys.shape[2])
    return cache


def steps(rounds: int = ROUNDS, quick: bool = False) -> int:
    """How many times ``run`` ticks (for a progress bar)."""
    return 1 + rounds + (6 if quick else len(PREFILL_TOKENS) * len(CONTEXTS))


def run(
    model: nn.Module,
    geometry: PageGeometry,
    store_dir: Path,
    tick: Tick = lambda: None,
    page_counts: tuple[int, ...] = PAGE_COUNTS,
    rounds: int = ROUNDS,
    quick: bool = False,
    encrypted: bool = False,
    codecs: tuple[str, ...] = (),
) -> dict:
    """The report behind ``kvtier bench restore --json``: ``measure``, and the shortest
    prompt worth restoring from each tier by a profile fitted to these samples and the
    model's timed prefills (``quick``: the quick calibration's shorter ones)."""
    report = measure(geometry, store_dir, page_counts, rounds, tick, encrypted, codecs)
    if quick:
        prefill = prefill_samples(model, tick, *quick_grid(model), repeats=QUICK_REPEATS)
    else:
        prefill = prefill_samples(model, tick)
    profile = _profile(report["links"], prefill)
    report["break_even_tokens"] = break_even_tokens(profile, geometry)
    return report


def _profile(links: list[dict], prefill: list[tuple[int, int, float]]) -> Profile:
    profile = Profile.defaults()
    for row in links:
        profile.links[row["link"]].samples.append((row["bytes"], row["seconds"]))
    profile.compute.samples.extend(prefill)
    for fitted in (*profile.links.values(), profile.compute):
        fitted.refit()
    return profile


def break_even_tokens(profile: Profile, geometry: PageGeometry, longest: int = 1 << 16) -> dict[str, int | None]:
    """Shortest prompt whose stored prefix in each tier is worth restoring (None: never, up to ``longest``)."""
    found: dict[str, int | None] = {}
    for tier in (Source.L2, Source.L3):
        found[tier.value] = None
        for pages in range(1, longest // geometry.page_size):
            n = pages * geometry.page_size + 1
            if plan_restore([tier] * pages, n, geometry.page_size, geometry.nbytes, profile).restore_pages:
                found[tier.value] = n
                break
    return found
