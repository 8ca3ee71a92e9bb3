"""Cost-model accuracy (issue 4): prediction error after calibration, and decision regret.

    python bench/cost_accuracy.py [--lengths 64 128 256 512 1024 2048 4096] [--repeats 3]
                                  [--throttle auto|none|RATE|L2=RATE|L3=RATE ...]
                                  [--pages 1 2 4 8 16 32 64] [--prefill N:P ...]
                                  [--page-size 128] [--codec raw] [--parts 1 2] [--json]

Everything runs on the embedded default model (float32, 24 layers; a page of 128
tokens is 3 MiB of KV) in temporary stores beside the kvtier home (same filesystem
as the real store), removed at the end. Calibration comes first, in the state a
fresh process is in (as ``kvtier calibrate`` runs): ``costmodel.calibrate.calibrate``
into a temporary store dir. That calibrated profile is the one every prediction and
every planner decision below uses.

1. Prediction error after calibration (target: median <= 20% for restores >= 1 MiB).
   - Restores: pages of the model's geometry are published into a ``TieredStore``
     (L1 off), then restores of ``--pages`` pages are timed from L2 and, after a flush
     and dropping L2's copies, from L3 (OS page cache warm; one untimed warm-up
     restore per size), ``--repeats`` times each, in the mlx state an ``Engine``
     leaves (buffer-cache limit raised). For each restore, every link whose counter
     moved (``store.stats().links`` before/after) gives one sample: predicted =
     the calibrated ``Profile.links[link].predict(bytes that crossed it)``, measured =
     the seconds the counter added. Links the profile has no model for are listed as
     such. An "Lx restore (wall)" row compares the planner's
     ``costmodel.plan.restore_seconds`` for the restored pages with the wall-clock
     time of ``restore`` plus evaluating the KV arrays.
   - Prefill: the model's forward over ``n`` new tokens after ``p`` cached
     (``--prefill N:P``), in chunks of the engine's ``prefill_step_size``, best of
     ``--repeats``, against ``ComputeModel.predict(n, p)``; and, from part 2, each
     prompt's full-recompute time to first token through the engine against
     ``predict(n, 0)`` (that one also holds admission, sampling and publication).
   Reported: median and p90 of |predicted - measured| / measured, per link and for
   compute, every repeat one sample.

2. Decision regret against an oracle that times both choices (target: <= 10%).
   For each prompt length (distinct random byte tokens per length, so no pages are
   shared across cases), the prompt's reusable prefix is stored in L2 (engine with
   L1 off) and, separately, only in L3 (after a flush, L2's copies dropped before
   every run), each without a throttle and with a read throttle on that tier
   (``StoreConfig.throttle``; ``auto`` picks the rate at which restoring the
   2048-token prompt's prefix is predicted to save as much as it costs, so restore
   loses below about 2048 tokens and wins above). Time to first token (submit to
   first token, ``max_tokens=1``) is measured for
     (a) forced restore of every matched page: ``Engine.profile`` set to a profile
         with free links and absurdly slow compute;
     (b) forced recompute of everything: links with an absurd setup time (timed
         once per length and reused across tiers and throttles, since it never
         touches the store);
     (c) the plan the engine picks with the calibrated profile (a fresh copy per run,
         so online refinement in one run does not steer the next).
   The recompute timings' first run also publishes the prompt's pages (L1 off: they
   land in L2), an extra page copy each, small next to prefilling a page.
   (c) runs first, once; if it restored exactly what (a) restores (same per-source
   token counts) that run counts as one of (a)'s repeats and t_c = t_a; if it
   recomputed everything it counts as a recompute sample and t_c = t_b; otherwise
   (c) is timed ``--repeats`` times itself. Each time is the best of ``--repeats``.
   Regret = (t_c - min(t_a, t_b)) / min(t_a, t_b); below 0 when (c) beat both (a
   partial or overlapped plan: compute the first pages while the rest load), which
   the two forced plans cannot show as a loss. Lengths with no full page to reuse
   (n - 1 < page size) are shown but left out of the summary (nothing to decide).
   The throttled-L2 case runs on a second store whose L2 gets the prefixes by
   ``publish`` of pages restored from the first (no second prefill).

The machine is noisy (2 cores, other work may run): only ratios from one run mean
anything; the load average at start and end is printed. Progress goes to stderr.
The default run takes minutes: most of it is the recompute timings (3 x 4096 tokens)
and the throttled restores; the wall time of each phase is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from kvtier.costmodel.calibrate import calibrate
from kvtier.costmodel.models import ComputeModel, LinkModel
from kvtier.costmodel.plan import restore_seconds
from kvtier.costmodel.profile import Profile
from kvtier.engine.blas import blas_in_use
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.models.load import load_model
from kvtier.engine.models.paths import kvtier_home
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig, TieredStore
from kvtier.tiers.page import Namespace, PageGeometry, Source, page_keys, reusable_pages

MIB = 1 << 20
LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)
PAGE_COUNTS = (1, 2, 4, 8, 16, 32, 64)
PREFILL = ((64, 0), (256, 0), (512, 0), (128, 1024), (512, 1024))
BREAK_EVEN_TOKENS = 2048  # where an ``auto`` throttle makes restore and recompute equal
RESTORE_TARGET, REGRET_TARGET = 0.20, 0.10
ONE_TOKEN = SamplingParams(max_tokens=1)
_T0 = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def error_summary(errors: Sequence[float]) -> dict:
    if not errors:
        return {"count": 0, "median": None, "p90": None}
    values = np.asarray(errors, float)
    return {"count": len(values), "median": float(np.median(values)), "p90": float(np.percentile(values, 90))}


def rel_error(predicted: float | None, measured: float) -> float | None:
    return abs(predicted - measured) / measured if predicted is not None and measured > 0 else None


def fresh(profile: Profile) -> Profile:
    """A deep copy (samples included), so online refinement in one run leaves the original alone."""
    return Profile.from_dict(profile.to_dict())


def random_tokens(n: int, seed: int) -> list[int]:
    """``n`` printable byte tokens, different per seed (so every page key differs)."""
    return [int(t) for t in np.random.default_rng(seed).integers(32, 127, n)]


# -- part 1: prediction error ---------------------------------------------------


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


# -- part 2: decision regret ----------------------------------------------------


def forced_profile(restore: bool, link_names: set[str]) -> Profile:
    """Restore every matched page (free links, absurd compute), or none (absurd link setup)."""
    if restore:
        links = {name: LinkModel.of(0.0, float("inf")) for name in link_names}
        return Profile(links, ComputeModel([1e6, 1e6, 0.0]), calibrated=True)
    links = {name: LinkModel.of(1e9, 1.0) for name in link_names}
    return Profile(links, ComputeModel([0.0, 1e-3, 0.0]), calibrated=True)


def signature(request) -> tuple:
    """What a run did: tokens per source (restored per tier, recomputed)."""
    return tuple(sorted(request.sources().items()))


def expected_signature(n: int, restored_tokens: int, tier: str) -> tuple:
    counts = {s.value: 0 for s in Source}
    if restored_tokens:
        counts[tier] = restored_tokens
    counts[Source.RECOMPUTED.value] = n - restored_tokens
    return tuple(sorted(counts.items()))


class Bench:
    """Engines over temporary stores, the calibrated profile and the shared recompute times."""

    def __init__(
        self, loaded, profile: Profile, page_size: int, root: Path, lengths: Sequence[int], repeats: int, codec: str
    ) -> None:
        self.loaded, self.profile, self.page_size, self.root = loaded, profile, page_size, root
        self.repeats, self.codec = repeats, codec
        self.prompts = {n: random_tokens(n, seed=1000 + n) for n in lengths}
        self.warmup = random_tokens(3 * page_size + 5, seed=999)
        self.recompute: dict[int, list[float]] = {}
        self.cases: list[dict] = []
        self.links: set[str] = set()
        total_pages = sum(reusable_pages(n, page_size) for n in (*lengths, len(self.warmup)))
        self.geometry = loaded.geometry(page_size)
        self.l2_bytes = (total_pages + 4) * self.geometry.nbytes
        self.l3_bytes = 2 * self.l2_bytes + (64 << 20)

    def engine(self, store_dir: Path, throttle: dict[str, float]) -> Engine:
        store = StoreConfig(
            l1_bytes=0,
            l2_bytes=self.l2_bytes,
            l3_bytes=self.l3_bytes,
            store_dir=store_dir,
            codec=self.codec,
            throttle=dict(throttle),
        )
        engine = Engine(self.loaded, EngineConfig(page_size=self.page_size, store=store))
        # Forced profiles name every link there is, so any path the planner takes finds a model.
        self.links |= set(Profile.defaults().links) | set(self.profile.links) | set(engine.store.stats().links)
        return engine

    def run(self, engine: Engine, prompt: list[int], profile: Profile, prepare: Callable[[], None]):
        prepare()
        engine.profile = profile
        (request,) = engine.generate([prompt], ONE_TOKEN)
        return request.t_first_token - request.t_submit, request

    def populate(self, engine: Engine) -> None:
        """Warm up, then time full recompute of every prompt; its first run publishes the prompt's
        pages (L1 off: they land in L2)."""
        recompute = lambda: forced_profile(False, self.links)  # noqa: E731
        self.run(engine, self.warmup, recompute(), lambda: None)
        self.run(engine, self.warmup, forced_profile(True, self.links), lambda: None)
        for n, prompt in self.prompts.items():
            samples = []
            for _ in range(self.repeats):  # the first run also publishes the prompt's pages
                seconds, request = self.run(engine, prompt, recompute(), lambda: None)
                if signature(request) != expected_signature(n, 0, "L2"):
                    progress(f"warning: forced recompute of {n} tokens ran {request.sources()}")
                samples.append(seconds)
            self.recompute[n] = samples
            progress(f"recompute {n} tokens: {', '.join(f'{t:.3f}' for t in samples)} s")

    def case(self, engine: Engine, tier: str, throttle: dict[str, float], prepare: Callable[[], None]) -> None:
        size = self.page_size
        rate = throttle.get(tier)
        capped = self.profile.capped(throttle)
        for n, prompt in self.prompts.items():
            pages = reusable_pages(n, size)
            row = {"tier": tier, "throttle_bytes_s": rate, "tokens": n, "pages": pages}
            if pages == 0:
                self.cases.append({**row, "t_recompute": min(self.recompute[n]), "note": "no full page to reuse"})
                continue
            want_restore = expected_signature(n, pages * size, tier)
            want_recompute = expected_signature(n, 0, tier)
            keys = page_keys(engine.namespace, prompt)[:pages]
            prepare()
            where = [s.value for s in engine.store.locate(keys, prompt)]
            notes = [] if where == [tier] * pages else [f"prefix found in {where}"]
            # (c) first, once.
            t, request = self.run(engine, prompt, fresh(self.profile), prepare)
            plan = request.plan.to_dict() if request.plan is not None else None
            chosen = signature(request)
            restore_t, recompute_t, planner_t = [], list(self.recompute[n]), [t]
            if chosen == want_restore:
                kind = "restore"
                restore_t.append(t)
            elif chosen == want_recompute:
                kind = "recompute"
                recompute_t.append(t)
            else:
                kind = "overlap" if plan and plan.get("overlap_pages") else "partial"
                for _ in range(self.repeats - 1):
                    t, again = self.run(engine, prompt, fresh(self.profile), prepare)
                    if signature(again) != chosen:
                        notes.append(f"planner changed its plan: {again.sources()}")
                    planner_t.append(t)
            while len(restore_t) < self.repeats:
                t, forced = self.run(engine, prompt, forced_profile(True, self.links), prepare)
                if signature(forced) != want_restore:
                    notes.append(f"forced restore ran {forced.sources()}")
                restore_t.append(t)
            t_a, t_b = min(restore_t), min(recompute_t)
            t_c = {"restore": t_a, "recompute": t_b}.get(kind, min(planner_t))
            best = min(t_a, t_b)
            load = predicted_load([Source(tier)] * pages, self.geometry.nbytes, capped, self.codec)
            pred_a = None if load is None else load + capped.compute.predict(n - pages * size, pages * size)
            self.cases.append(
                {
                    **row,
                    "t_restore": t_a,
                    "t_recompute": t_b,
                    "t_chosen": t_c,
                    "chosen": kind,
                    "chosen_sources": dict(chosen),
                    "oracle": "restore" if t_a <= t_b else "recompute",
                    "regret": (t_c - best) / best,
                    "plan": plan,
                    "predicted_restore_s": pred_a,
                    "predicted_recompute_s": capped.compute.predict(n, 0),
                    "restore_all_s": restore_t,
                    "recompute_all_s": recompute_t,
                    "chosen_all_s": planner_t,
                    "note": "; ".join(notes),
                }
            )
            progress(
                f"{tier} throttle={_rate_text(rate)} {n} tokens: restore {t_a:.3f} s, recompute {t_b:.3f} s, "
                f"chose {kind} -> regret {(t_c - best) / best:.1%}"
            )

    def all_cases(self, throttles: dict[str, float]) -> None:
        main = self.root / "store"
        e1 = self.engine(main, {})
        self.populate(e1)
        self.case(e1, "L2", {}, lambda: None)
        if "L2" in throttles:
            e3 = self.engine(self.root / "store-l2-throttled", {"L2": throttles["L2"]})
            for prompt in self.prompts.values():  # same namespace: copy the stored prefixes over, no prefill
                copy_prefix(e1, e3, prompt)
            self.case(e3, "L2", {"L2": throttles["L2"]}, lambda: None)
            e3.close()
        e1.store.keeping.flush()
        self.case(e1, "L3", {}, lambda: e1.store.keeping.drop_l2())
        e1.close()
        if "L3" in throttles:
            e2 = self.engine(main, {"L3": throttles["L3"]})
            self.case(e2, "L3", {"L3": throttles["L3"]}, lambda: e2.store.keeping.drop_l2())
            e2.close()


def copy_prefix(src: Engine, dst: Engine, prompt: list[int]) -> None:
    """Publish ``prompt``'s stored pages of ``src`` into ``dst`` (L1 off there: they land in L2)."""
    assert src.namespace == dst.namespace
    size = src.config.page_size
    keys = page_keys(src.namespace, prompt)[: reusable_pages(len(prompt), size)]
    restored = src.store.restore(keys, prompt)
    try:
        for i, key in enumerate(restored.keys):
            a, b = i * size, (i + 1) * size
            kv = mx.stack([mx.stack([k[0, :, a:b], v[0, :, a:b]]) for k, v in restored.layers])
            mx.eval(kv)
            dst.store.publish(key, prompt[a:b], kv)
    finally:
        src.store.release(restored.keys)


# -- throttle choice -------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_rate(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*?)(?:/s)?\s*", text)
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"bad rate {text!r} (use e.g. 4MiB/s)")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def auto_rate(profile: Profile, geometry: PageGeometry, length: int = BREAK_EVEN_TOKENS) -> float:
    """Read rate at which restoring ``length``'s prefix is predicted to cost what it saves."""
    size = geometry.page_size
    pages = reusable_pages(length, size)
    saved = profile.compute.predict(length, 0) - profile.compute.predict(length - pages * size, pages * size)
    return pages * geometry.nbytes / saved if saved > 0 else 4.0 * MIB


def throttles_from(specs: list[str], profile: Profile, geometry: PageGeometry) -> dict[str, float]:
    throttles: dict[str, float] = {}
    for spec in specs or ["auto"]:
        if spec == "none":
            continue
        tier, _, rate = spec.rpartition("=")
        value = auto_rate(profile, geometry) if rate == "auto" else parse_rate(rate)
        for t in [tier] if tier else ["L2", "L3"]:
            if t not in ("L2", "L3"):
                raise SystemExit(f"bad throttle {spec!r}: tier L2 or L3")
            throttles[t] = value
    return throttles


def _rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / MIB:.2f}MiB/s"


# -- report ---------------------------------------------------------------------


def restore_report(rows: list[dict]) -> dict:
    big = [r for r in rows if r["bytes"] >= MIB]
    report = {}
    for link in dict.fromkeys(r["link"] for r in big):
        mine = [r for r in big if r["link"] == link]
        errors = [r["error"] for r in mine if r["error"] is not None]
        summary = error_summary(errors)
        summary["samples"] = len(mine)
        summary["no_model"] = len(mine) - len(errors)
        summary["meets_target"] = summary["median"] is not None and summary["median"] <= RESTORE_TARGET
        report[link] = summary
    return report


def compute_report(prefill: list[dict], bench: Bench | None) -> dict:
    forward = [e for r in prefill for e in r["errors"] if e is not None]
    report = {"forward": error_summary(forward)}
    if bench is not None and bench.recompute:
        engine_errors = []
        for n, samples in bench.recompute.items():
            predicted = bench.profile.compute.predict(n, 0)
            engine_errors.extend(rel_error(predicted, t) for t in samples)
        report["engine_ttft_recompute"] = error_summary(engine_errors)
    return report


def regret_report(cases: list[dict]) -> dict:
    decided = [c for c in cases if "regret" in c]
    regrets = [c["regret"] for c in decided]
    out = {
        "cases": len(decided),
        "median": statistics.median(regrets) if regrets else None,
        "max": max(regrets) if regrets else None,
    }
    for throttled in (False, True):
        mine = [c["regret"] for c in decided if (c["throttle_bytes_s"] is not None) == throttled]
        out["throttled" if throttled else "unthrottled"] = {
            "cases": len(mine),
            "median": statistics.median(mine) if mine else None,
            "max": max(mine) if mine else None,
        }
    out["meets_target"] = bool(regrets) and out["max"] <= REGRET_TARGET
    out["median_meets_target"] = bool(regrets) and out["median"] <= REGRET_TARGET
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def print_tables(report: dict) -> None:
    meta = report["meta"]
    print(
        f"cost-model accuracy: model {meta['model']}, page {meta['page_size']} tokens "
        f"({meta['page_bytes'] / MIB:.1f} MiB), codec {meta['codec']}, repeats {meta['repeats']}"
    )
    print(f"BLAS: {meta['blas']}")
    print(f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']} (noisy machine: read ratios)")
    cal = report["calibration"]
    print("\ncalibrated profile (calibrate(), as `kvtier calibrate` runs it):")
    for name, link in cal["links"].items():
        sized = meta["calibration_sizes"].get(name, 0)
        fitted = f"fitted on {sized} sizes" if sized else "no calibration sample moved bytes: defaults"
        print(f"  {name}: setup {link['setup_s'] * 1e3:.3f} ms, {link['gib_s']:.2f} GiB/s ({fitted})")
    c = cal["compute"]
    print(f"  prefill: T(n, p) = {c['c0']:.4g} + {c['c1']:.4g}*n + {c['c2']:.4g}*n*(p + n/2) s")

    if "restore" in report:
        rows = report["restore"]["rows"]
        print(
            "\n1a. restores: predicted (calibrated link model of the bytes each link's counter moved) "
            "vs measured (the counter's seconds); 'Lx restore (wall)': planner's restore_seconds vs wall clock"
        )
        print(f"{'from':<4} {'pages':>5} {'MiB':>7} {'link':<17} {'pred ms':>9} {'meas ms':>9} {'error':>7}")
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            groups.setdefault((r["tier"], r["pages"], r["link"]), []).append(r)
        for (tier, pages, link), mine in groups.items():
            measured = statistics.median(r["measured_s"] for r in mine)
            errors = [r["error"] for r in mine if r["error"] is not None]
            print(
                f"{tier:<4} {pages:>5} {mine[0]['bytes'] / MIB:>7.1f} {link:<17} {_ms(mine[0]['predicted_s']):>9} "
                f"{_ms(measured):>9} {_pct(statistics.median(errors)) if errors else 'no model':>7}"
            )
        print(f"\n   summary, restores >= 1 MiB (target: median <= {RESTORE_TARGET:.0%}):")
        print(f"   {'link':<17} {'samples':>7} {'median':>7} {'p90':>7}  target")
        for link, s in report["restore"]["summary"].items():
            verdict = "no model in profile" if s["median"] is None else ("ok" if s["meets_target"] else "MISSED")
            extra = f" ({s['no_model']} without a model)" if s["no_model"] and s["median"] is not None else ""
            print(f"   {link:<17} {s['samples']:>7} {_pct(s['median']):>7} {_pct(s['p90']):>7}  {verdict}{extra}")

    if "prefill" in report:
        print(
            "\n1b. prefill: ComputeModel.predict(n, p) vs forward time (chunks of prefill_step_size, best of repeats)"
        )
        print(f"{'n':>6} {'p':>6} {'pred s':>9} {'meas s':>9} {'error':>7}")
        for r in report["prefill"]:
            print(
                f"{r['n']:>6} {r['p']:>6} {r['predicted_s']:>9.3f} {r['measured_s']:>9.3f} "
                f"{_pct(rel_error(r['predicted_s'], r['measured_s'])):>7}"
            )
        for name, s in report["compute_error"].items():
            print(f"   {name}: samples {s['count']}, median {_pct(s['median'])}, p90 {_pct(s['p90'])}")
        if report.get("recompute_ttft"):
            print("   full recompute through the engine (TTFT) vs predict(n, 0):")
            for n, (pred, best) in report["recompute_ttft"].items():
                print(
                    f"     n={n:>5}: predicted {pred:.3f} s, measured (best) {best:.3f} s, "
                    f"error {_pct(rel_error(pred, best))}"
                )

    if "regret" in report:
        print(
            f"\n2. decision regret (TTFT, best of {meta['repeats']}; throttles: "
            f"{ {k: _rate_text(v) for k, v in report['throttles'].items()} }, auto = break-even at "
            f"{BREAK_EVEN_TOKENS} tokens)"
        )
        print(
            f"{'tier':<4} {'throttle':>12} {'tokens':>6} {'pages':>5} {'restore s':>9} {'recomp s':>9} "
            f"{'pred rest':>9} {'pred reco':>9} {'oracle':>9} {'chosen':>9} {'pred chos':>9} "
            f"{'chosen s':>9} {'regret':>7}"
        )
        for c in report["regret"]["cases"]:
            if "regret" not in c:
                print(
                    f"{c['tier']:<4} {_rate_text(c['throttle_bytes_s']):>12} {c['tokens']:>6} {c['pages']:>5} "
                    f"{'-':>9} {c['t_recompute']:>9.3f}   ({c['note']})"
                )
                continue
            pred_a = "-" if c["predicted_restore_s"] is None else f"{c['predicted_restore_s']:.3f}"
            pred_c = "-" if not c.get("plan") else f"{c['plan']['predicted_s']:.3f}"
            print(
                f"{c['tier']:<4} {_rate_text(c['throttle_bytes_s']):>12} {c['tokens']:>6} {c['pages']:>5} "
                f"{c['t_restore']:>9.3f} {c['t_recompute']:>9.3f} {pred_a:>9} {c['predicted_recompute_s']:>9.3f} "
                f"{c['oracle']:>9} {c['chosen']:>9} {pred_c:>9} {c['t_chosen']:>9.3f} {_pct(c['regret']):>7}"
                + (f"  [{c['note']}]" if c.get("note") else "")
            )
        s = report["regret"]["summary"]
        print(
            f"   summary over {s['cases']} cases with pages to reuse (target <= {REGRET_TARGET:.0%}): "
            f"median {_pct(s['median'])}, max {_pct(s['max'])} -> "
            f"{'ok' if s['meets_target'] else ('median ok, max MISSED' if s['median_meets_target'] else 'MISSED')}"
        )
        for name in ("unthrottled", "throttled"):
            t = s[name]
            print(f"   {name}: {t['cases']} cases, median {_pct(t['median'])}, max {_pct(t['max'])}")
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in meta["phases_s"].items())
    print(f"\nwall time {report['meta']['elapsed_s']:.0f} s ({phases})")


# -- main -----------------------------------------------------------------------


def parse_pair(text: str) -> tuple[int, int]:
    n, _, p = text.partition(":")
    if not (n.isdigit() and p.isdigit() and int(n) > 0):
        raise argparse.ArgumentTypeError(f"bad prefill pair {text!r} (use N:P, e.g. 256:1024)")
    return int(n), int(p)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="prompt lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per measurement (best is kept)")
    parser.add_argument(
        "--throttle",
        action="append",
        default=[],
        metavar="auto|none|RATE|TIER=RATE",
        help="read throttle for the throttled cases (default auto, both tiers)",
    )
    parser.add_argument("--pages", type=int, nargs="+", default=list(PAGE_COUNTS), help="restore sizes (pages)")
    parser.add_argument("--prefill", type=parse_pair, nargs="+", default=list(PREFILL), metavar="N:P")
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--codec", default="raw", help="L3 codec of the stores (raw, zstd)")
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args(argv)

    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    phases: dict[str, float] = {}
    mark = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = now - mark
        mark = now

    loaded = load_model()
    geometry = loaded.geometry(args.page_size)
    home = kvtier_home()
    home.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    with tempfile.TemporaryDirectory(dir=home, prefix="bench-cost-accuracy-") as tmp:
        root = Path(tmp)
        progress("calibrating")
        profile = calibrate(loaded.model, geometry, root / "calibration")
        report["calibration"] = profile.summary().to_json()
        sizes = {name: len({x[0] for x in link.samples if x[0] > 0}) for name, link in profile.links.items()}
        phase("calibration")
        if 1 in args.parts:
            rows = restore_samples(
                geometry, profile, root / "restore", sorted(set(args.pages)), args.repeats, args.codec
            )
            report["restore"] = {"rows": rows, "summary": restore_report(rows)}
            phase("restores")
            step = EngineConfig().prefill_step_size
            report["prefill"] = prefill_samples(loaded.model, profile, args.prefill, args.repeats, step)
            phase("prefill")
        bench = None
        if 2 in args.parts:
            throttles = throttles_from(args.throttle, profile, geometry)
            report["throttles"] = throttles
            bench = Bench(loaded, profile, args.page_size, root, sorted(set(args.lengths)), args.repeats, args.codec)
            bench.all_cases(throttles)
            report["regret"] = {"cases": bench.cases, "summary": regret_report(bench.cases)}
            report["recompute_ttft"] = {n: (profile.compute.predict(n, 0), min(s)) for n, s in bench.recompute.items()}
            phase("regret")
        if "prefill" in report or bench is not None:
            report["compute_error"] = compute_report(report.get("prefill", []), bench)
            if "prefill" not in report:
                report["prefill"] = []
    report["meta"] = {
        "model": loaded.name,
        "page_size": args.page_size,
        "page_bytes": geometry.nbytes,
        "codec": args.codec,
        "repeats": args.repeats,
        "blas": blas_in_use(),
        "loadavg_start": loadavg_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "elapsed_s": time.perf_counter() - _T0,
        "phases_s": phases,
        "argv": sys.argv[1:],
        "calibration_sizes": sizes,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print_tables(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
