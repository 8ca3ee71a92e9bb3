"""``kvtier serve``: the OpenAI- and Anthropic-compatible HTTP server on the engine."""

from __future__ import annotations

import argparse
import signal
import socket
import sys

from ..interrupts import stop_on_signals
from .common import UsageError, check_sizes, load_model, pages_kept, usable_store
from .session import close_engine, open_engine


def cmd_serve(args: argparse.Namespace) -> int:
    from ..serve.app import DEFAULT_MODEL_ID, KVTierServer, ServerConfig
    from ..serve.draining import DrainingServer

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    try:  # bound before the model loads: a busy port fails at once; --port 0 takes a free one
        sock = socket.create_server((args.host, args.port), family=family)
    except OSError as err:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from None
    store_dir = None if args.no_offload else usable_store(args.store)
    check_sizes(args, store_dir)
    loaded = load_model(args.model)
    engine = open_engine(args, loaded, store_dir, max_running=args.max_running, publish_answers=True)
    try:
        model_id = args.served_model_name or args.model or DEFAULT_MODEL_ID
        config = ServerConfig(model_id, args.max_waiting, args.max_tokens, tool_warm_s=args.tool_warm)
        server = KVTierServer(engine, config)
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
        close_engine(engine, cancel=True)
    print(f"kvtier: stopped; {pages_kept(args)}", file=sys.stderr)
    return 0
