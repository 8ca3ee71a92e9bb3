"""Part 2 of ``bench/cost_accuracy.py``: decision regret against an oracle that times
restore and recompute, and the read throttles of its throttled cases (the script's
docstring says what and how)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import kvtier  # noqa: F401  (loads OpenBLAS, before mlx: mlx binds its BLAS when first imported)

# isort: split
import mlx.core as mx

from kvtier.costmodel.models import ComputeModel, LinkModel
from kvtier.costmodel.profile import Profile
from kvtier.engine.engine import Engine, EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.page import PageGeometry, Source, page_keys, reusable_pages

sys.path.insert(0, str(Path(__file__).parent))
from cost_accuracy_report import BREAK_EVEN_TOKENS, MIB, rate_text  # noqa: E402
from cost_accuracy_samples import fresh, predicted_load, progress, random_tokens  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1)


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
                f"{tier} throttle={rate_text(rate)} {n} tokens: restore {t_a:.3f} s, recompute {t_b:.3f} s, "
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
