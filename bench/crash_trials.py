"""Crash trials: writers killed with SIGKILL at random moments, then the store is checked.

    python bench/crash_trials.py [--trials 200] [--tiered-every 5] [--cli-trials 10]
                                 [--seed N] [--max-delay 0.35] [--store DIR] [--json]

Store trials (the same harness as ``tests/tiers/test_reliability.py``, more of them):
a child process writes pages to one L3 store, through ``DiskTier`` or (every
``--tiered-every``-th trial) through ``TieredStore`` spills, with random codecs, queue
sizes, LRU touches and side-table writes, and is killed at a random moment (during
start-up, while opening the store, or mid-write). After each kill the store must open,
every record must be one that was written and read back byte-identical (checksum
checked), and meta bytes_used/pages, lru and order must match the records.

CLI trials (``tests/engine/test_failures.py``): ``kvtier run`` on four prompts with
small L1/L2 (pages spill to L3 mid-run), killed as soon as the store file grows or at a
random moment after it opened the store; each record must check, and each trial
brings new prompts; one ``kvtier run --json`` of all of them after the kills must give the
output token ids of ``--no-offload`` and restore every page the kills left servable.

Prints how many trials ran and were killed, how many pages were verified and survived,
and every failure; exits 1 if there was one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.tiers.test_reliability import CrashLog, crash_trial  # noqa: E402


def store_trials(store: Path, trials: int, seed: int, tiered_every: int, max_delay: float) -> dict:
    rng = random.Random(seed)
    log = CrashLog(capacity=1 << 20)
    t0 = time.perf_counter()
    for t in range(trials):
        mode = "tiered" if tiered_every and t % tiered_every == tiered_every - 1 else "disk"
        try:
            crash_trial(store, log, rng, mode, count=2000 if mode == "disk" else 1500, max_delay=max_delay)
        except AssertionError:
            break  # recorded in log.failures; the store is left as it was for inspection
    return {
        "trials": log.trials,
        "killed": log.killed,
        "pages_verified": log.pages_verified,
        "pages_survived": log.survived,
        "failures": log.failures,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def cli_trials(store: Path, trials: int, seed: int) -> dict:
    from kvtier.engine.models.load import load_model
    from tests.engine.test_failures import (
        cli_crash_trial,
        leading_stored_pages,
        outputs,
        prompt_page_keys,
        prompt_set,
        run,
        seed_profile,
        verify_records,
    )

    rng = random.Random(seed)
    t0 = time.perf_counter()
    loaded = load_model()
    seed_profile(store, loaded)  # so that the planner restores what the kills left
    killed, records, failures = 0, [], []
    for t in range(trials):  # each trial brings four new prompts: it has pages to write
        try:
            result = cli_crash_trial(store, rng, prompt_set(t), grown=t % 3 == 0)
        except AssertionError as exc:
            failures.append(f"cli trial {t + 1}: {exc}")
            break
        killed += result["killed"]
        records.append(result["records"])
    report = {"trials": len(records), "killed": killed, "records_after_each": records}
    if not failures:  # one run of every trial's prompts, against --no-offload
        everything = [p for t in range(trials) for p in prompt_set(t)]
        expected = outputs(run(None, prompts=everything)[0])
        leading = leading_stored_pages(store, everything, loaded)
        results, counters, _ = run(store, prompts=everything)
        restored = sum(r["sources"]["L1"] + r["sources"]["L2"] + r["sources"]["L3"] for r in results) // 8
        if outputs(results) != expected:
            failures.append("after the kills: outputs differ from --no-offload")
        if counters["tiers"]["L3"]["checksum_failures"]:
            failures.append(f"after the kills: {counters['tiers']['L3']['checksum_failures']} checksum failures")
        if restored != leading:
            failures.append(f"after the kills: {restored} pages restored, {leading} servable were stored")
        if verify_records(store) != len({k for keys in prompt_page_keys(everything, loaded) for k in keys}):
            failures.append("after the kills: a full run did not leave every page in L3")
        report.update(
            prompts=len(everything),
            servable_pages_left=leading,
            pages_restored=restored,
            outputs_equal=outputs(results) == expected,
        )
    report.update(failures=failures, seconds=round(time.perf_counter() - t0, 1))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200, help="store-level trials")
    parser.add_argument(
        "--tiered-every", type=int, default=5, help="every Nth store trial writes through TieredStore (0: never)"
    )
    parser.add_argument("--cli-trials", type=int, default=0, help="kvtier run trials (about 3 s each)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-delay", type=float, default=0.35, help="longest wait after the child is ready, s")
    parser.add_argument("--store", type=Path, default=None, help="parent directory of the stores (default: temporary)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    root = args.store or Path(tempfile.mkdtemp(prefix="kvtier-crash-"))
    report = {"seed": seed, "stores": str(root)}
    if args.trials:
        report["store"] = store_trials(root / "store", args.trials, seed, args.tiered_every, args.max_delay)
    if args.cli_trials:
        report["cli"] = cli_trials(root / "cli-store", args.cli_trials, seed)
    failures = [f for part in ("store", "cli") for f in report.get(part, {}).get("failures", [])]
    if args.json:
        print(json.dumps(report))
    else:
        print(f"seed {seed}, stores under {root}")
        if "store" in report:
            s = report["store"]
            print(
                f"store trials: {s['trials']} ({s['killed']} killed mid-run), {s['pages_verified']} pages "
                f"verified, {s['pages_survived']} pages of killed writers survived intact, {s['seconds']} s"
            )
        if "cli" in report:
            c = report["cli"]
            print(
                f"cli trials: {c['trials']} ({c['killed']} killed), records after each kill "
                f"{c['records_after_each']}; then one run of all {c.get('prompts')} prompts: outputs equal "
                f"to --no-offload: {c.get('outputs_equal')}, {c.get('pages_restored')} pages restored of "
                f"{c.get('servable_pages_left')} servable left by the kills, {c['seconds']} s"
            )
        print(f"failures: {len(failures)}")
        for failure in failures:
            print("  " + failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
