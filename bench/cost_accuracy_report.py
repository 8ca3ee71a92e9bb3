"""The report of ``bench/cost_accuracy.py``: error and regret summaries against their
targets, and the tables it prints (the measuring is in ``cost_accuracy.py``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np

from kvtier.costmodel.models import ComputeModel

MIB = 1 << 20
BREAK_EVEN_TOKENS = 2048  # where an ``auto`` throttle makes restore and recompute equal
RESTORE_TARGET, REGRET_TARGET = 0.20, 0.10


def error_summary(errors: Sequence[float]) -> dict:
    if not errors:
        return {"count": 0, "median": None, "p90": None}
    values = np.asarray(errors, float)
    return {"count": len(values), "median": float(np.median(values)), "p90": float(np.percentile(values, 90))}


def rel_error(predicted: float | None, measured: float) -> float | None:
    return abs(predicted - measured) / measured if predicted is not None and measured > 0 else None


def rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / MIB:.2f}MiB/s"


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


def compute_report(prefill: list[dict], recompute: dict[int, list[float]], compute: ComputeModel) -> dict:
    """Prefill errors, and of the engine's full recomputes (``recompute``: TTFT samples
    per prompt length) against ``compute``'s prediction."""
    forward = [e for r in prefill for e in r["errors"] if e is not None]
    report = {"forward": error_summary(forward)}
    if recompute:
        engine_errors = []
        for n, samples in recompute.items():
            predicted = compute.predict(n, 0)
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
            f"{ {k: rate_text(v) for k, v in report['throttles'].items()} }, auto = break-even at "
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
                    f"{c['tier']:<4} {rate_text(c['throttle_bytes_s']):>12} {c['tokens']:>6} {c['pages']:>5} "
                    f"{'-':>9} {c['t_recompute']:>9.3f}   ({c['note']})"
                )
                continue
            pred_a = "-" if c["predicted_restore_s"] is None else f"{c['predicted_restore_s']:.3f}"
            pred_c = "-" if not c.get("plan") else f"{c['plan']['predicted_s']:.3f}"
            print(
                f"{c['tier']:<4} {rate_text(c['throttle_bytes_s']):>12} {c['tokens']:>6} {c['pages']:>5} "
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
