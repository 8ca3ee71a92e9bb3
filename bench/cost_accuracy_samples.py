"""Part 1 of ``bench/cost_accuracy.py``: restores and prefills timed against the
calibrated profile's predictions (the script's docstring says what and how)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from kvtier.costmodel.plan import restore_seconds
from kvtier.costmodel.profile import Profile
from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import Namespace, PageGeometry, Source, page_keys

sys.path.insert(0, str(Path(__file__).parent))
from cost_accuracy_report import rel_error  # noqa: E402

STARTED = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def fresh(profile: Profile) -> Profile:
    """A deep copy (samples included), so online refinement in one run leaves the original alone."""
    return Profile.from_dict(profile.to_dict())


def random_tokens(n: int, seed: int) -> list[int]:
    """``n`` printable byte tokens, different per seed (so every page key differs)."""
    return [int(t) for t in np.random.default_rng(seed).integers(32, 127, n)]


def predicted_load(sources: Sequence[Source], page_bytes: int, profile: Profile, codec: str) -> float | None:
    """The planner's predicted time to bring these pages into a request's KV (None: a link
    on its path has no model)."""
    try:
        return restore_seconds(sources, page_bytes, profile, codec)
    except KeyError:
        return None


def timed_restore(store: TieredStore, keys: list, tokens: list[int]) -> tuple[list[Source], float, dict]:
    """Sources, wall seconds (restore + evaluating the KV) and per-link deltas of one restore."""
    before = store.stats().links
    t0 = time.perf_counter()
    restored = store.restore(keys, tokens)
    mx.eval([a for kv in restored.layers for a in kv])
    wall = time.perf_counter() - t0
    after = store.stats().links
    store.release(restored.keys)
    moved = {
        name: {"bytes": now.bytes - before[name].bytes, "seconds": now.seconds - before[name].seconds}
        for name, now in after.items()
    }
    return list(restored.sources), wall, {k: v for k, v in moved.items() if v["bytes"] > 0}


def restore_samples(
    geometry: PageGeometry, profile: Profile, root: Path, counts: Sequence[int], repeats: int, codec: str
) -> list[dict]:
    """One row per (restore, link) and one "restore (wall)" row per restore."""
    pages = max(counts)
    tokens = random_tokens(pages * geometry.page_size + 1, seed=7)
    namespace = Namespace("kvtier-bench-cost-accuracy", geometry.dtype, geometry.page_size)
    keys = page_keys(namespace, tokens)[:pages]
    config = StoreConfig(
        l1_bytes=0,
        l2_bytes=(pages + 2) * geometry.nbytes,
        l3_bytes=(2 * pages + 8) * geometry.nbytes,
        store_dir=root,
        codec=codec,
    )
    store = TieredStore(geometry, namespace, config)
    rng = np.random.default_rng(0)
    size = geometry.page_size
    for i, key in enumerate(keys):
        kv = mx.array(rng.standard_normal(geometry.shape, dtype=np.float32)).astype(getattr(mx, geometry.dtype))
        store.publish(key, tokens[i * size : (i + 1) * size], kv)
    rows = []
    try:
        for tier in ("L2", "L3"):
            if tier == "L3":
                store.keeping.flush()
                store.keeping.drop_l2()
                timed_restore(store, keys, tokens)  # warm the OS page cache and LMDB's map
            for k in counts:
                for attempt in range(repeats + 1):  # the first is an untimed warm-up
                    if tier == "L3":
                        store.keeping.drop_l2()
                    sources, wall, moved = timed_restore(store, keys[:k], tokens)
                    if attempt == 0:
                        continue
                    if set(sources) != {Source(tier)} or len(sources) != k:
                        progress(f"warning: restore of {k} {tier} pages came from {sources}")
                    for link, m in moved.items():
                        model = profile.links.get(link)
                        predicted = model.predict(m["bytes"]) if model is not None else None
                        rows.append(
                            {
                                "tier": tier,
                                "pages": k,
                                "link": link,
                                "bytes": m["bytes"],
                                "predicted_s": predicted,
                                "measured_s": m["seconds"],
                                "error": rel_error(predicted, m["seconds"]),
                            }
                        )
                    predicted = predicted_load(sources, geometry.nbytes, profile, codec)
                    rows.append(
                        {
                            "tier": tier,
                            "pages": k,
                            "link": f"{tier} restore (wall)",
                            "bytes": k * geometry.nbytes,
                            "predicted_s": predicted,
                            "measured_s": wall,
                            "error": rel_error(predicted, wall),
                        }
                    )
                progress(f"restore from {tier}: {k} pages")
    finally:
        store.close()
    return rows


def prefill_samples(model, profile: Profile, pairs: Sequence[tuple[int, int]], repeats: int, step: int) -> list[dict]:
    """Chunked forward passes of ``n`` tokens after ``p`` cached, best of ``repeats``."""
    tokens = mx.array([random_tokens(max(n + p for n, p in pairs), seed=11)])
    mx.eval(model(tokens[:, :8]))  # warm-up: kernels

    def forward(cache, start: int, stop: int) -> None:
        for a in range(start, stop, step):
            mx.eval(model(tokens[:, a : min(stop, a + step)], cache=cache))

    rows = []
    cache, filled = make_prompt_cache(model), 0
    for p in sorted({p for _, p in pairs}):
        forward(cache, filled, p)  # extend the context to p
        filled = p
        for n in sorted(n for n, q in pairs if q == p):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                forward(cache, p, p + n)
                times.append(time.perf_counter() - t0)
                trim_prompt_cache(cache, n)
            predicted = profile.compute.predict(n, p)
            rows.append(
                {
                    "n": n,
                    "p": p,
                    "predicted_s": predicted,
                    "measured_s": min(times),
                    "all_s": times,
                    "errors": [rel_error(predicted, t) for t in times],
                }
            )
            progress(f"prefill n={n} p={p}: {min(times):.3f} s")
    return rows
