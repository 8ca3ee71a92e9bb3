"""``kvtier route``: a cache-aware router in front of ``kvtier serve`` backends that
share a Redis L3 (DESIGN §11); its flags, and the process (uvicorn on one socket, as
``serve``: SIGTERM or Ctrl-C stop it, exit 0)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from urllib.parse import urlsplit

from ..route.placement import Policy
from .args import non_negative_int, port_number, positive_number, redis_url
from .common import ProgressBar, UsageError
from .serve import listen
from .tree import Tree


def backend_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise argparse.ArgumentTypeError(f"expected a backend's base URL, http://HOST:PORT, got {text!r}")
    try:
        parts.port  # noqa: B018 (a port out of range raises)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return text.rstrip("/")


def add_route_parser(tree: Tree, sub) -> None:
    route = tree.command(sub, "route", "a cache-aware router in front of several `kvtier serve` backends")
    route.add_argument(
        "--backend",
        action="append",
        type=backend_url,
        required=True,
        metavar="URL",
        help="a backend's base URL, http://HOST:PORT (repeatable; at least one)",
    )
    route.add_argument("--host", default="127.0.0.1", help="address to listen on")
    route.add_argument("--port", type=port_number, default=8080, help="0 takes a free port (printed)")
    route.add_argument("--model", help="the backends' model: its tokenizer renders prompts (default: serve's default)")
    route.add_argument(
        "--l3-redis", type=redis_url, metavar="URL", help="the Redis / Valkey L3 the backends share (their --store)"
    )
    route.add_argument(
        "--policy",
        choices=[policy.value for policy in Policy],
        default=Policy.CACHE_AWARE.value,
        help="where requests go (default: %(default)s)",
    )
    route.add_argument(
        "--max-imbalance",
        type=non_negative_int,
        default=4,
        metavar="N",
        help="skip a backend with N more requests than the least loaded one, even if it holds the prefix",
    )
    route.add_argument(
        "--deadline",
        type=positive_number,
        default=300.0,
        metavar="SECONDS",
        help="the longest a client waits for an answer to start (then 504)",
    )
    route.add_argument(
        "--api-key",
        metavar="KEY",
        help="an admin key of the backends, for their event streams (default: $KVTIER_API_KEY)",
    )


def cmd_route(args: argparse.Namespace) -> int:
    import uvicorn

    from ..route.app import RouterApp
    from ..route.backend import Backend
    from ..route.l3 import SharedL3
    from ..route.placement import Placer

    if len(set(args.backend)) != len(args.backend):
        raise UsageError("a --backend is given twice")
    sock = listen(args.host, args.port)
    try:
        l3 = SharedL3(args.l3_redis) if args.l3_redis else None
    except ValueError as err:
        raise UsageError(f"--l3-redis: {err}") from None
    tokenizer, fingerprint = _tokenizer(args.model)
    backends = [Backend(url, fingerprint) for url in args.backend]
    placer = Placer(backends, Policy(args.policy), args.max_imbalance, l3)
    router = RouterApp(tokenizer, backends, placer, args.deadline, args.api_key or os.environ.get("KVTIER_API_KEY"), l3)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # -v: the router's lines, not one per health check
    level = "info" if args.verbose else "warning"
    server = uvicorn.Server(uvicorn.Config(router.app, log_level=level, timeout_graceful_shutdown=5))
    port = sock.getsockname()[1]
    print(
        f"kvtier: routing to {len(backends)} backends ({args.policy}) on http://{args.host}:{port}",
        file=sys.stderr,
        flush=True,
    )
    server.run(sockets=[sock])
    print("kvtier: router stopped", file=sys.stderr)
    return 0


def _tokenizer(name: str | None):
    from ..models.load import ModelError, load_tokenizer

    with ProgressBar("importing model") as bar:
        try:
            return load_tokenizer(name, progress=bar.update)
        except ModelError as err:
            raise UsageError(str(err)) from None
