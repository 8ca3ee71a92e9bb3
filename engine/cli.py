"""``kvtier`` command line (DESIGN §8). Library code logs; this module prints."""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Sequence

from kvtier.tiers.hierarchy import StoreConfig

from .blas import blas_in_use
from .paths import default_store_dir

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise UsageError(message)


def parse_size(text: str) -> int:
    """Bytes from ``512MiB``, ``4GiB``, ``1.5GB`` or a plain number."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 512MiB, 4GiB or bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


def parse_throttle(text: str) -> tuple[str, float]:
    """``L3=2MiB/s`` -> ("L3", bytes per second)."""
    tier, _, rate = text.partition("=")
    if tier not in ("L2", "L3") or not rate.endswith("/s"):
        raise argparse.ArgumentTypeError(f"bad throttle {text!r} (use e.g. L3=2MiB/s or L2=1GiB/s)")
    bytes_per_s = parse_size(rate[:-2])
    if bytes_per_s <= 0:
        raise argparse.ArgumentTypeError(f"throttle rate must be positive in {text!r}")
    return tier, float(bytes_per_s)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The model, engine and store flags that ``run`` and ``serve`` share."""
    parser.add_argument("--model", help="mlx-lm model directory or hub id (default: embedded model)")
    parser.add_argument("--store", type=Path, default=None, help="L3 directory (default: user cache)")
    parser.add_argument("--l1-bytes", type=parse_size, default=parse_size("1GiB"))
    parser.add_argument("--l2-bytes", type=parse_size, default=parse_size("4GiB"))
    parser.add_argument("--l3-bytes", type=parse_size, default=parse_size("32GiB"))
    parser.add_argument("--page-size", type=positive_int, default=128)
    parser.add_argument("--codec", choices=["raw", "zstd"], default="raw", help="L3 payload codec")
    parser.add_argument("--cache-salt", default="", help="isolate this tenant's pages")
    parser.add_argument("--throttle", type=parse_throttle, action="append", default=[], metavar="TIER=RATE",
                        help="cap a tier's read bandwidth, e.g. L3=2MiB/s (tests and demos)")
    parser.add_argument("--single-flight", choices=["off", "after-prefill", "at-completion"],
                        default="after-prefill", help="identical concurrent prompts: compute once, release "
                        "followers after the leader's prefill (default) or completion")
    parser.add_argument("--refresh-window", type=int, default=128, metavar="N",
                        help="touch the L1 pages of the first N waiting requests before each admission")
    parser.add_argument("--no-offload", action="store_true", help="no store: recompute every prompt")


def engine_config(args: argparse.Namespace):
    """The EngineConfig that ``add_engine_flags``' flags describe."""
    from .engine import EngineConfig

    store = StoreConfig(args.l1_bytes, args.l2_bytes, args.l3_bytes,
                        args.store or default_store_dir(), args.codec, throttle=dict(args.throttle))
    return EngineConfig(page_size=args.page_size, offload=not args.no_offload, store=store,
                        cache_salt=args.cache_salt, single_flight=args.single_flight,
                        refresh_window=max(args.refresh_window, 0))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvtier", description="Tiered KV-cache offload for MLX inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="generate with a tiered KV cache")
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="raw completion prompt (repeat for a burst)")
    src.add_argument("--prompts-file", type=Path, help="JSONL: {\"prompt\": text} or {\"tokens\": [ids]}")
    run.add_argument("--max-tokens", type=positive_int, default=32)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    add_engine_flags(run)
    run.add_argument("--sequential", action="store_true", help="submit each prompt after the previous finishes")
    run.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    run.add_argument("--json", action="store_true", help="one JSON object per request, then counters")

    calibrate = sub.add_parser("calibrate", help="measure links and prefill; store the cost profile")
    calibrate.add_argument("--store", type=Path, default=None)
    calibrate.add_argument("--model", help="mlx-lm model directory or hub id (default: embedded model)")
    calibrate.add_argument("--page-size", type=positive_int, default=128)

    bench = sub.add_parser("bench", help="measure the store on this machine")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    restore = bench_sub.add_parser("restore", help="restore bandwidth per link against size, beside memcpy")
    restore.add_argument("--store", type=Path, default=None)
    restore.add_argument("--model", help="mlx-lm model directory or hub id (default: embedded model)")
    restore.add_argument("--page-size", type=positive_int, default=128)
    restore.add_argument("--json", action="store_true")
    restore.add_argument("--plot", type=Path, metavar="FILE.png", help="draw bandwidth against size (needs matplotlib)")

    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server on the engine")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=8000, help="0 takes a free port (printed)")
    add_engine_flags(serve)
    serve.add_argument("--served-model-name", help="the model id clients send (default: --model as given)")
    serve.add_argument("--max-tokens", type=positive_int, default=512,
                       help="tokens to generate when a request names no limit")
    serve.add_argument("--max-running", type=positive_int, default=32, help="requests decoded together")
    serve.add_argument("--max-waiting", type=positive_int, default=64,
                       help="requests queued for a batch slot; more answer 429")
    serve.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, let requests in flight finish this long, then cancel them")

    stats = sub.add_parser("stats", help="counters persisted in a store")
    stats.add_argument("--store", type=Path, default=None)
    fmt = stats.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--prometheus", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `kvtier ... | head` ends quietly, like any Unix tool (output comes after the store closes)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="kvtier: %(levelname)s: %(message)s")
        commands = {"run": cmd_run, "serve": cmd_serve, "stats": cmd_stats, "calibrate": cmd_calibrate, "bench": cmd_bench}
        return commands[args.command](args)
    except UsageError as err:
        print(f"kvtier: error: {err}", file=sys.stderr)
        return 2


def _read_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    if args.prompt is not None:
        texts: list = list(args.prompt)
    else:
        texts = _read_jsonl(args.prompts_file)
    prompts = []
    for item in texts:
        if isinstance(item, list):
            prompts.append(item)
        elif args.chat:
            messages = [{"role": "user", "content": item}]
            prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
        else:
            prompts.append(tokenizer.encode(item))
    return prompts


def _read_jsonl(path: Path) -> list:
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror}") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            item = record["tokens"] if "tokens" in record else record["prompt"]
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"{path}:{number}: expected {{\"prompt\": text}} or {{\"tokens\": [ids]}}") from None
        if not isinstance(item, (str, list)) or (isinstance(item, list) and not all(isinstance(t, int) for t in item)):
            raise UsageError(f"{path}:{number}: prompt must be text, tokens a list of ids")
        items.append(item)
    if not items:
        raise UsageError(f"{path} holds no prompts")
    return items


def _load_model(name: str | None):
    from .model import ModelError, load_model

    logging.getLogger("kvtier").info("BLAS: %s", blas_in_use())
    try:
        return load_model(name)
    except ModelError as err:
        raise UsageError(str(err)) from None


def cmd_run(args: argparse.Namespace) -> int:
    # Imported here so that `kvtier --help` and bad arguments answer at once.
    from .engine import Engine, InputError
    from .request import SamplingParams

    loaded = _load_model(args.model)
    prompts = _read_prompts(args, loaded.tokenizer)
    params = SamplingParams(args.max_tokens, args.temperature, args.top_p)
    engine = Engine(loaded, engine_config(args))
    try:
        requests = [engine.submit(p, params) for p in ([] if args.sequential else prompts)]
        engine.run()
        for prompt in prompts if args.sequential else []:
            requests.append(engine.submit(prompt, params))
            engine.run()
    except InputError as err:
        raise UsageError(str(err)) from None
    finally:
        engine.close()
    results = [engine.result(r) for r in requests]
    if args.json:
        for result in results:
            print(json.dumps(result))
        print(json.dumps({"counters": engine.stats()}))
    else:
        _print_human(results, engine.stats())
    return 0


def port_number(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}")
    return int(text)


def cmd_serve(args: argparse.Namespace) -> int:
    import dataclasses

    import uvicorn

    from .engine import Engine
    from .server import KVTierServer, ServerConfig

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:  # bound before the model loads: a busy port fails at once; --port 0 takes a free one
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as err:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from None
    loaded = _load_model(args.model)
    config = dataclasses.replace(engine_config(args), max_running=args.max_running, publish_answers=True)
    server = KVTierServer(Engine(loaded, config),
                          ServerConfig(args.served_model_name or loaded.name, args.max_waiting, args.max_tokens))
    uv = uvicorn.Server(uvicorn.Config(server.app, lifespan="on", log_level="info" if args.verbose else "warning",
                                       timeout_graceful_shutdown=args.drain_timeout))
    # uvicorn handles SIGTERM/SIGINT (stop accepting, drain), then raises the signal again
    # once it has shut down; these handlers take that second delivery, so the store is
    # flushed below and the exit status is 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    if hasattr(signal, "SIGPIPE"):  # a client gone before its answer is written is an error, not our end
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    server.start()
    port = sock.getsockname()[1]
    print(f"kvtier: serving {server.config.model_name} on http://{args.host}:{port}", file=sys.stderr, flush=True)
    try:
        uv.run(sockets=[sock])
    finally:
        server.close()
    return 0


def _print_human(results: list[dict], stats: dict) -> None:
    for r in results:
        print(f"── request {r['id']}: {r['prompt_tokens']} prompt tokens, "
              f"ttft {r['ttft_s'] * 1000:.0f} ms, {len(r['output_token_ids'])} tokens out")
        print(r["text"])
        print("   sources: " + "  ".join(f"{k}={v}" for k, v in r["sources"].items()))
    print()
    print(format_tier_table(stats))
    if not stats["costmodel"]["calibrated"]:
        print("\ncost model: defaults (run `kvtier calibrate` to measure this machine)")


def format_tier_table(stats: dict) -> str:
    """Per-tier and per-link counters as a small text table."""
    cols = ("capacity", "bytes_used", "pages", "lookups", "hit_pages", "hit_tokens",
            "inserts", "evictions", "checksum_failures", "writes_dropped")
    lines = ["tier " + " ".join(f"{c:>12.12}" for c in cols)]
    for name, tier in stats.get("tiers", {}).items():
        lines.append(f"{name:<4} " + " ".join(f"{tier.get(c, 0):>12}" for c in cols))
    lines.append("")
    lines.append(f"{'link':<7} {'bytes':>14} {'pages':>8} {'seconds':>10} {'GiB/s':>8}")
    for name, link in stats.get("links", {}).items():
        if link.get("pages"):
            rate = link["bytes"] / link["seconds"] / (1 << 30) if link["seconds"] else 0.0
            lines.append(f"{name:<7} {link['bytes']:>14} {link['pages']:>8} {link['seconds']:>10.4f} {rate:>8.2f}")
    return "\n".join(lines)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.costmodel.calibrate import calibrate, steps
    from kvtier.tiers.disk import DiskTier, StoreError

    loaded = _load_model(args.model)
    geometry = loaded.geometry(args.page_size)
    store_dir = args.store or default_store_dir()
    with tqdm(total=steps(), desc="calibrating", unit="sample", file=sys.stderr) as bar:
        try:
            profile = calibrate(loaded.model, geometry, store_dir, bar.update)
        except (OSError, StoreError) as err:
            raise UsageError(f"cannot calibrate with store {store_dir}: {err}") from None
    try:
        disk = DiskTier(store_dir, capacity_bytes=0)
    except StoreError as err:
        raise UsageError(str(err)) from None
    disk.put_meta(loaded.profile_key(geometry), profile.to_dict())
    disk.close()
    summary = profile.summary()
    for name, link in summary["links"].items():
        print(f"{name}: setup {link['setup_s'] * 1e3:.3f} ms, {link['gib_s']:.2f} GiB/s")
    c = summary["compute"]
    print(f"prefill: T(n, p) = {c['c0']:.4g} + {c['c1']:.4g}*n + {c['c2']:.4g}*n*(p + n/2) s")
    print(f"profile saved in {store_dir}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.costmodel import bandwidth

    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    loaded = _load_model(args.model)
    geometry = loaded.geometry(args.page_size)
    total = 2 * len(bandwidth.PAGE_COUNTS) + 1 + 9
    with tqdm(total=total, desc="measuring", unit="step", file=sys.stderr) as bar:
        report = bandwidth.run(loaded.model, geometry, args.store or default_store_dir(), bar.update)
    report["blas"] = blas_in_use()
    if args.plot is not None:
        _plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{'link':<7} {'pages':>6} {'MiB':>8} {'GiB/s':>7} {'memcpy':>7} {'ratio':>6}")
    for row in report["links"]:
        print(f"{row['link']:<7} {row['pages']:>6} {row['bytes'] / (1 << 20):>8.1f} {row['gib_s']:>7.2f} "
              f"{row['memcpy_gib_s']:>7.2f} {row['ratio_to_memcpy']:>6.2f}")
    limits, peer = report["limits"], report["peer"]
    print(f"\nwhole prompt ({limits['bytes'] / (1 << 20):.0f} MiB): memcpy {limits['memcpy_gib_s']:.2f} GiB/s, "
          f"LMDB zero-copy read {limits['lmdb_zero_copy_read_gib_s']:.2f}, zstd decompress "
          f"{limits['zstd_decompress_gib_s']:.2f}")
    print(f"restore from L3 {peer['ours_l3_gib_s']:.2f} GiB/s vs mlx_lm load_prompt_cache "
          f"{peer['load_prompt_cache_gib_s']:.2f} GiB/s: {peer['ratio']:.2f}x")
    for tier, tokens in report["break_even_tokens"].items():
        print(f"break-even prompt length for {tier}: {tokens if tokens else 'never (recompute wins)'} tokens")
    return 0


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for link in sorted({r["link"] for r in report["links"]}):
        rows = [r for r in report["links"] if r["link"] == link]
        ax.plot([r["bytes"] / (1 << 20) for r in rows], [r["gib_s"] for r in rows], marker="o", label=link)
    rows = report["links"]
    ax.plot([r["bytes"] / (1 << 20) for r in rows], [r["memcpy_gib_s"] for r in rows], "k:", label="memcpy")
    ax.set(xscale="log", xlabel="restore size (MiB)", ylabel="GiB/s", title="kvtier restore bandwidth")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def cmd_stats(args: argparse.Namespace) -> int:
    from kvtier.tiers.disk import DiskTier, StoreError

    path = args.store or default_store_dir()
    if not (path / "data.mdb").exists():
        raise UsageError(f"no kvtier store at {path}")
    try:
        disk = DiskTier(path, capacity_bytes=0)
    except StoreError as err:
        raise UsageError(str(err)) from None
    try:
        counters = disk.persistent_counters()
        counters["last_run"] = disk.get_meta("last_run") or {}
        counters.setdefault("tiers", {}).setdefault("L3", {}).update(
            bytes_used=disk.counters.bytes_used, pages=disk.counters.pages)
    finally:
        disk.close()
    if args.json:
        print(json.dumps(counters))
    elif args.prometheus:
        print(format_prometheus(counters), end="")
    else:
        print(format_tier_table(counters))
        engine = counters.get("engine", {})
        if engine:
            print()
            print("requests {requests}  prompt tokens {prompt_tokens}  generated {generated_tokens}".format(
                **{k: engine.get(k, 0) for k in ("requests", "prompt_tokens", "generated_tokens")}))
            print("sources: " + "  ".join(f"{k}={v}" for k, v in engine.get("sources", {}).items()))
            print(f"L1 hit loss between enqueue and admission: {engine.get('l1_hit_loss_tokens', 0)} tokens")
        if counters["last_run"]:
            print()
            print(format_last_run(counters["last_run"]))
    return 0


def format_last_run(last: dict) -> str:
    """The last run's window and cost-model fit, with prediction errors."""
    window = last.get("windowed", {})
    lines = [f"last run ({last.get('model')}): cached tokens/s over {window.get('window_s', 0):.0f} s: "
             f"{window.get('cached_tokens_per_s', 0):.1f}"]
    cost = last.get("costmodel", {})
    lines.append(f"cost model: {'calibrated' if cost.get('calibrated') else 'defaults'}")
    rows = [(name, f"setup {m['setup_s'] * 1e3:.3f} ms, {m['gib_s']:.2f} GiB/s", m["error"])
            for name, m in cost.get("links", {}).items()]
    if "compute" in cost:
        c = cost["compute"]
        rows.append(("prefill", f"{c['c0']:.3g} + {c['c1']:.3g}*n + {c['c2']:.3g}*n*(p+n/2) s", c["error"]))
    for name, fit, error in rows:
        err = (f"error median {error['median']:.0%}, p90 {error['p90']:.0%} over {error['count']}"
               if error.get("count") else "no predictions checked yet")
        lines.append(f"  {name:<8} {fit:<42} {err}")
    return "\n".join(lines)


def format_prometheus(counters: dict) -> str:
    """Store counters in the Prometheus text exposition format."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    _add_gauges(registry, "tier", counters.get("tiers", {}))
    _add_gauges(registry, "link", counters.get("links", {}))
    engine = counters.get("engine", {})
    _add_gauges(registry, "source", {s: {"prompt_tokens": v} for s, v in engine.get("sources", {}).items()})
    return generate_latest(registry).decode()


def _add_gauges(registry, label: str, table: dict[str, dict]) -> None:
    """One gauge per field, labelled by row: ``kvtier_tier_pages{tier="L1"}``."""
    from prometheus_client import Gauge

    gauges: dict[str, Gauge] = {}
    for row, fields in table.items():
        for name, value in fields.items():
            if name not in gauges:
                gauges[name] = Gauge(f"kvtier_{label}_{name}", f"kvtier {name} per {label}", [label], registry=registry)
            gauges[name].labels(**{label: row}).set(value)


if __name__ == "__main__":
    sys.exit(main())
