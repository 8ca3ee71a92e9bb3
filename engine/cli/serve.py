"""``kvtier serve``: the OpenAI- and Anthropic-compatible HTTP server on the engine."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
from pathlib import Path

from kvtier.tiers.l3.base import StoreError
from kvtier.tiers.l3.secret import SECRET_BYTES, read_or_create

from ..interrupts import stop_on_signals
from .common import UsageError, check_sizes, engine_store, load_model, pages_kept
from .encryption import secret_path
from .session import close_engine, open_engine


def cmd_serve(args: argparse.Namespace) -> int:
    from ..serve.app import DEFAULT_MODEL_ID, KVTierServer, ServerConfig
    from ..serve.draining import DrainingServer

    keys = api_keys(args)
    shared = {path: _read_text(path, "--shared-prefix") for path in args.shared_prefix}
    sock = listen(args.host, args.port)  # before the model loads: a busy port fails at once
    store_dir = engine_store(args)
    check_sizes(args, store_dir)
    secret = server_secret(args, store_dir)
    loaded = load_model(args.model)
    engine = open_engine(args, loaded, store_dir, max_running=args.max_running, publish_answers=True)
    try:
        model_id = args.served_model_name or args.model or DEFAULT_MODEL_ID
        config = ServerConfig(model_id, args.max_waiting, args.max_tokens, tool_warm_s=args.tool_warm)
        server = KVTierServer(engine, config, tenancy(keys, secret, engine, shared))
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
        unflushed = close_engine(engine, cancel=True, timeout_s=args.flush_timeout)
        if unflushed is not None:
            _exit_unflushed(unflushed, args.flush_timeout)
    print(f"kvtier: stopped; {pages_kept(args)}", file=sys.stderr)
    return 0


def _exit_unflushed(pages: int, timeout_s: float) -> None:
    """The store did not close within ``--flush-timeout`` (a frozen disk, a hung Redis):
    one line, and exit 1 at once, without waiting for the threads stuck on it (what L3
    committed stays whole: a transaction commits or does not)."""
    print(
        f"kvtier: stopped without a full flush: {pages} pages not written to L3 within "
        f"--flush-timeout {timeout_s:g} s (the store did not answer); what it committed is intact",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(1)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (``--port 0`` takes a free one), or one error line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as err:
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def api_keys(args: argparse.Namespace) -> dict:
    """The keys of ``--api-key`` (each its own tenant, an admin: the operator's) and
    ``--api-keys FILE``; without any, a host other than loopback is refused unless
    ``--insecure-no-auth`` says so (then one warning line)."""
    from ..serve.tenancy import Caller, KeyFileError, own_tenant, read_key_file

    keys = {key: Caller(own_tenant(key), admin=True) for key in args.api_key}
    if args.api_keys is not None:
        try:
            keys.update(read_key_file(args.api_keys))
        except KeyFileError as err:
            raise UsageError(str(err)) from None
    if not keys and not _loopback(args.host):
        if not args.insecure_no_auth:
            raise UsageError(
                f"refusing to serve on {args.host} without API keys: anyone who can reach it reads what others "
                "sent through the cache; give --api-key or --api-keys FILE (or --insecure-no-auth)"
            )
        print(
            f"kvtier: warning: serving on {args.host} without API keys (--insecure-no-auth): every client "
            "shares one cache and can read what others sent through it",
            file=sys.stderr,
        )
    return keys


def server_secret(args: argparse.Namespace, store_dir: Path | str | None) -> bytes:
    """The server secret tenant roots are derived from, the one ``--encrypt-l3`` uses
    (``encryption.secret_path``). Without a store nothing is cached, so nothing needs
    keeping apart across restarts: a secret of this process's."""
    if store_dir is None:
        return os.urandom(SECRET_BYTES)
    try:
        return read_or_create(secret_path(args, store_dir))
    except StoreError as err:
        raise UsageError(str(err)) from None


def tenancy(keys: dict, secret: bytes, engine, shared_texts: dict[Path, str]):
    """The server's tenancy: its keys, the secret, the token prefixes of the shared system
    prompts (one warning line for a prompt shorter than a page: nothing of it is shared)."""
    from ..serve.tenancy import Tenancy, system_prefixes

    tokenizer, page = engine.loaded.tokenizer, engine.config.page_size
    shared = []
    for path, text in shared_texts.items():
        prefixes = system_prefixes(tokenizer, text)
        if all(len(prefix) < page for prefix in prefixes):
            longest = max(map(len, prefixes))
            print(
                f"kvtier: warning: --shared-prefix {path} is {longest} tokens, less than a page "
                f"({page}): nothing of it is shared",
                file=sys.stderr,
            )
        shared += prefixes
    return Tenancy(keys, secret, engine.root, page, shared)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{flag} {path}: {getattr(err, 'strerror', None) or err}") from None
